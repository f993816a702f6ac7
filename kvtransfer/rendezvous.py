"""Rendezvous for the torch.distributed KV transport: stores, control records, pair groups.

Runs in prefill and decode workers, in the transport's helper threads (never in the engine
thread: every call here may block, each for at most its timeout).

There is no global world. Each worker that can receive KV serves a `TCPStore` (the decode
side; ``is_master``, on ``host:0``, the bound port goes into its tickets). A prefill worker
that wants to push KV to it connects as a store client and:

1. takes a new generation ``g = store.add("kvx/gen/<sender>", 1)`` (so a restarted or
   re-joining sender never collides with its previous incarnation);
2. pushes a ``join`` record (sender id, g, its KV layout) onto the control queue
   ``kvx/ctl`` (`TCPStore.queue_push`, atomic: no half-written records);
3. waits for the receiver's verdict ``kvx/join/<sender>/<g>`` (``ok``; ``ok:shm`` when the
   join carried a shared cache the receiver could map, `kvtransfer.shm`; or the layout
   mismatch, which names both values);
4. both sides build a 2-rank process group on ``PrefixStore("kvx/pair/<sender>/<g>/")``:
   decode is rank 0, prefill rank 1. A torn-down pair is never reused: the next use makes
   generation g+1 with a fresh prefix, so stale keys and sockets cannot mix in.

Per transfer the sender pushes one ``xfer`` record (transfer id, epoch, g, message tag,
token count, time left) on the same queue, then streams the layers and a trailer over the
pair's group; the receiver acknowledges over the group (see `kvtransfer.wire`). The receiver
publishes the generation it currently serves for each sender under ``kvx/cur/<sender>`` so a
sender notices a pair the receiver dropped before it announces a transfer on it. A sender that
cancels mid-stream streams filler for the missing layers and says so in the trailer; one that
cancels before announcing pushes a ``cancel`` record instead.

Control records are JSON text; nothing read from a store is unpickled.

Cluster secret: with a `RecordSeal` (`security.kvseal`; both sides hold the cluster secret)
every record a receiver acts on must carry a valid MAC (`decode` raises `RecordRejected`
otherwise; a rejected join is answered ``reject:...``), a join's shared-memory offer travels
encrypted, verdicts are signed (`verdict_text` / `read_verdict`), a join must name the newest
generation its sender took (so an old join replayed is stale), and a pair's group keys live
under a prefix only the two can compute (`pair_prefix`). Without a seal, records travel as
they are (a cluster without a secret).
"""

from __future__ import annotations

import json
import logging
from datetime import timedelta
from typing import Any, Literal, Protocol, cast

import torch
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store, TCPStore, Work

from kvtransfer.types import layout_from_dict, layout_to_dict
from model_runtime.kv_cache import KVLayout
from security.kvseal import RecordSeal

log = logging.getLogger(__name__)

CTL_QUEUE = "kvx/ctl"
Backend = Literal["gloo", "nccl"]


class PairGroup(Protocol):
    """The point-to-point part of a 2-rank process group (gloo or NCCL backend)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> Work: ...


def gen_key(sender: str) -> str:
    return f"kvx/gen/{sender}"


def cur_key(sender: str) -> str:
    return f"kvx/cur/{sender}"


def join_key(sender: str, gen: int) -> str:
    return f"kvx/join/{sender}/{gen}"


def pair_prefix(sender: str, gen: int, seal: RecordSeal | None = None) -> str:
    """Where a pair's group keys live; with a seal, a prefix only the two peers can compute."""
    if seal is not None:
        return f"kvx/pair/{seal.pair_tag(sender, gen)}/"
    return f"kvx/pair/{sender}/{gen}/"


class RecordRejected(ValueError):
    """A control record without a valid MAC (or with an offer that does not open)."""

    def __init__(self, why: str, record: dict[str, Any]) -> None:
        super().__init__(why)
        self.kind = str(record.get("kind"))
        self.sender = str(record.get("sender", "?"))
        gen = record.get("gen")
        self.gen = gen if isinstance(gen, int) else None


def backend_for(device: torch.device) -> Backend:
    """NCCL between CUDA caches, gloo between CPU caches."""
    return "nccl" if device.type == "cuda" else "gloo"


def _td(seconds: float) -> timedelta:
    return timedelta(seconds=max(seconds, 0.001))


def serve_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """Start this worker's rendezvous store (the receiving side); ``port=0`` picks a free one."""
    return TCPStore(host, port, is_master=True, wait_for_workers=False, timeout=_td(timeout_s))


def connect_store(host: str, port: int, timeout_s: float) -> TCPStore:
    """Connect to a receiver's store as a client (blocks at most `timeout_s`)."""
    return TCPStore(host, port, is_master=False, wait_for_workers=False, timeout=_td(timeout_s))


class Refusals:
    """A receiver's count of records refused for want of the cluster secret's MAC. A refused
    join is told why (so a misconfigured peer fails fast, not at its timeout); the log gets
    the first ten refusals, then every 1000th (a flood of forged records floods nothing)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self.count = 0

    def note(self, exc: RecordRejected, store: Store) -> None:
        self.count += 1
        if self.count <= 10 or self.count % 1000 == 0:
            log.warning(
                "kvtransfer: %s refused a %s record claiming to be from %r: %s (%d so far)",
                self.worker_id, exc.kind, exc.sender, exc, self.count,
            )  # fmt: skip
        if exc.kind == "join" and exc.gen is not None and "/" not in exc.sender:
            store.set(join_key(exc.sender, exc.gen), f"reject:{exc}")


def encode(record: dict[str, Any], seal: RecordSeal | None = None) -> str:
    """JSON text of `record`, signed when `seal` is given."""
    return json.dumps(record if seal is None else seal.sign(record), separators=(",", ":"))


def decode(raw: bytes | str, seal: RecordSeal | None = None) -> dict[str, Any]:
    """Parse a control record; ValueError when it is not a JSON object with a ``kind``.
    With `seal`: `RecordRejected` unless its MAC checks out; a join's sealed offer is opened
    into ``shm``."""
    text = raw.decode() if isinstance(raw, bytes) else raw
    rec = json.loads(text)
    if not isinstance(rec, dict) or not isinstance(rec.get("kind"), str):
        raise ValueError(f"malformed control record: {text[:200]!r}")
    if seal is None:
        rec.pop("shm_sealed", None)  # an open cluster cannot read a sealed offer: no offer
        return rec
    if not seal.verify(rec):
        raise RecordRejected("record not signed with this cluster's secret", rec)
    del rec["mac"]
    sealed = rec.pop("shm_sealed", None)
    if sealed is not None:
        try:
            rec["shm"] = seal.open_offer(str(sealed), str(rec["sender"]), int(rec["gen"]))
        except (KeyError, ValueError) as exc:
            raise RecordRejected(str(exc), rec) from None
    return rec


def join_record(
    sender: str,
    gen: int,
    layout: KVLayout,
    shm: dict[str, Any] | None = None,
    seal: RecordSeal | None = None,
) -> str:
    """`shm`: the sender's shared cache (`kvtransfer.shm.SegmentInfo.to_dict`), if it has one
    (encrypted for the receiver when `seal` is given)."""
    rec = {"kind": "join", "sender": sender, "gen": gen, "layout": layout_to_dict(layout)}
    if shm is not None and seal is not None:
        rec["shm_sealed"] = seal.seal_offer(shm, sender, gen)
    elif shm is not None:
        rec["shm"] = shm
    return encode(rec, seal)


JOIN_OK = "ok"  # join verdicts; anything else is "reject:<why>"
JOIN_OK_SHM = "ok:shm"  # accepted, and the receiver reads the sender's cache in place
UNSIGNED_VERDICT = "reject:the receiver's answer is not signed with this cluster's secret"


def verdict_text(verdict: str, sender: str, gen: int, seal: RecordSeal | None = None) -> str:
    """What the receiver stores under `join_key` (signed with a seal)."""
    return verdict if seal is None else seal.sign_verdict(verdict, sender, gen)


def read_verdict(raw: bytes, sender: str, gen: int, seal: RecordSeal | None = None) -> str:
    """The verdict stored under `join_key`; with a seal, `UNSIGNED_VERDICT` unless its MAC
    checks out (a reject is shown as it came, for a misconfigured peer's sake)."""
    text = raw.decode(errors="replace")
    if seal is None:
        return text
    verdict = seal.open_verdict(text, sender, gen)
    if verdict is not None:
        return verdict
    return text if text.startswith("reject:") and "|mac:" not in text else UNSIGNED_VERDICT


def join_layout(record: dict[str, Any]) -> KVLayout:
    return layout_from_dict(record["layout"])


def xfer_record(
    sender: str,
    gen: int,
    transfer_id: str,
    epoch: int,
    tag: int,
    num_tokens: int,
    timeout_ms: int,
    src_block_ids: list[int] | None = None,
    seal: RecordSeal | None = None,
) -> str:
    """A transfer header; `timeout_ms` is what is left of the sender's deadline.
    `src_block_ids` (shared-memory pairs only): where the receiver reads the layers from."""
    rec: dict[str, Any] = {
        "kind": "xfer",
        "sender": sender,
        "gen": gen,
        "transfer_id": transfer_id,
        "epoch": epoch,
        "tag": tag,
        "num_tokens": num_tokens,
        "timeout_ms": timeout_ms,
    }
    if src_block_ids is not None:
        rec["src"] = src_block_ids
    return encode(rec, seal)


def cancel_record(sender: str, transfer_id: str, epoch: int, seal: RecordSeal | None = None) -> str:
    """A sender gave up on a transfer before announcing it: fail it now, not at its deadline."""
    rec = {"kind": "cancel", "sender": sender, "transfer_id": transfer_id, "epoch": epoch}
    return encode(rec, seal)


def stop_record(seal: RecordSeal | None = None) -> str:
    return encode({"kind": "stop"}, seal)


def make_pair_group(
    store: Store,
    sender: str,
    gen: int,
    rank: int,
    backend: Backend,
    host: str,
    timeout_s: float,
    seal: RecordSeal | None = None,
) -> PairGroup:
    """Build the 2-rank group of one (sender, generation); blocks until the peer joins.

    Gloo binds its device to `host` (the worker's address, 127.0.0.1 for single-host runs).
    """
    prefixed = PrefixStore(pair_prefix(sender, gen, seal), store)
    if backend == "gloo":
        # The runtime class is `_Options` (with `_devices`); the shipped stubs lag behind.
        opts = ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = _td(timeout_s)
        opts._devices = [ProcessGroupGloo.create_device(hostname=host)]
        return cast(PairGroup, ProcessGroupGloo(prefixed, rank, 2, opts))
    from torch._C._distributed_c10d import ProcessGroupNCCL  # absent from CPU-only builds

    nccl_opts = ProcessGroupNCCL.Options()
    nccl_opts._timeout = _td(timeout_s)
    return cast(PairGroup, ProcessGroupNCCL(prefixed, rank, 2, nccl_opts))
