"""Real KV-transfer worker processes for tests: each runs `_worker_main`, a small engine loop
that owns a `KVCache`, a `TorchDistTransport` and a block ledger, takes commands from the test
over a pipe and reports transfer results (with a SHA-256 of the KV it sent or received, so the
test compares bytes without shipping tensors). `Peer` is the test's handle on one.

Blocks are held by the rules of `kvtransfer.base`: the decode side from `expect` until the
result, the prefill side from `open` until the result; the ledger's free count must come back to
`BLOCKS` after any fault. A worker scribbles over blocks the moment it frees them after a send
or a failed receive, as a reused block would be, so a transfer that still read (or wrote) them
after its result shows up as a wrong digest. Processes are stopped by PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from multiprocessing.connection import Connection
from typing import Any

import torch

from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import TransferTicket, blocks_needed, new_ticket
from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache

# Workers fork from a server that has already imported torch: a fresh `spawn` re-imports it
# for every worker, which costs seconds each on a busy 2-core machine.
mp.get_context("forkserver").set_forkserver_preload(
    ["torch", "kvtransfer.torch_dist", "model_runtime.kv_cache", "tests.fakes.kv_workers"]
)

LAYERS, BLOCK, BLOCKS, HEADS, HEAD_DIM = 3, 4, 64, 2, 8
LONG = 30.0  # a transfer's default deadline (joins may meet the sandbox's 5 s connect stalls)


def _cache(seed: int | None, head_dim: int = HEAD_DIM, device: str = "cpu") -> KVCache:
    cfg = ModelConfig(
        architecture="llama",
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=HEADS,
        head_dim=head_dim,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=1e4,
    )
    cache = KVCache(cfg, BLOCKS, BLOCK, torch.float32, device=device, model_name="m")
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def _digest(cache: KVCache, blocks: list[int], layers: range = range(LAYERS)) -> str:
    h = hashlib.sha256()
    for layer in layers:
        h.update(cache.gather_layer(layer, blocks).cpu().numpy().tobytes())
    return h.hexdigest()


def _worker_main(
    conn: Connection,
    role: str,
    worker_id: str,
    seed: int,
    head_dim: int,
    shm: bool,
    device: str = "cpu",
) -> None:
    """One worker process: engine loop over commands, transport polls and layer pacing."""
    cache = _cache(seed if role != "decode" else None, head_dim, device)
    scribble = torch.Generator().manual_seed(seed + 1000)
    tr = TorchDistTransport(
        cache, worker_id, serve=role != "prefill", connect_timeout_s=LONG, shared_memory=shm
    )
    held: Counter[int] = Counter()
    blocks: dict[str, list[int]] = {}  # transfer id -> blocks held for it
    pacing: dict[str, list[float]] = {}  # transfer id -> [next layer, interval, next time]
    hold_at: dict[str, int] = {}  # transfer id -> the layer it is not handed over from, yet
    handed: Counter[str] = Counter()  # transfer id -> layers handed to the transport so far
    scribbled: dict[str, tuple[list[int], str]] = {}  # failed receive -> (blocks, digest)
    conn.send(("ready", {"port": tr.endpoint.port}))
    while True:
        if conn.poll(0.001):
            cmd, arg = conn.recv()
            if cmd == "stop":
                tr.close()
                conn.send(("stopped", {}))
                return
            if cmd == "status":
                conn.send(("status", {"free": BLOCKS - len(+held), "in_flight": len(blocks)}))
            elif cmd == "handed":  # prefill: how many layers of `tid` went to the transport
                conn.send(("handed", {"layers": handed[arg["tid"]]}))
            elif cmd == "layer_digest":  # either side: one layer of the blocks held for `tid`
                layer = range(arg["layer"], arg["layer"] + 1)
                conn.send(("layer_digest", {"digest": _digest(cache, blocks[arg["tid"]], layer)}))
            elif cmd == "release":  # prefill: hand over the layers of `tid` held by `hold_at`
                hold_at.pop(arg["tid"], None)
                conn.send(("released", {}))
            elif cmd == "shm_peers":
                conn.send(("shm_peers", {"peers": tr.shared_memory_peers()}))
            elif cmd == "expect":  # decode: reserve blocks, issue a ticket
                # Descending ids are scattered (received via staging buffers); ascending ones
                # of a free stretch are consecutive (received straight into the blocks).
                n = blocks_needed(arg["num_tokens"], BLOCK)
                ids = range(BLOCKS) if arg.get("ascending") else range(BLOCKS - 1, -1, -1)
                free = [b for b in ids if held[b] == 0][:n]
                ticket = new_ticket(
                    tr.endpoint, tr.layout, "req", free, arg["num_tokens"], arg["timeout_s"]
                )
                held.update(free)
                blocks[ticket.transfer_id] = free
                tr.expect(ticket)
                conn.send(("ticket", ticket.to_dict()))
            elif cmd == "open":  # prefill: hold the source blocks, stream layers
                ticket = TransferTicket.from_dict(arg["ticket"])
                held.update(arg["src"])
                blocks[ticket.transfer_id] = list(arg["src"])
                tr.open(ticket, arg["src"])
                pacing[ticket.transfer_id] = [0, arg["interval_s"], time.monotonic()]
                if arg.get("hold_at") is not None:
                    hold_at[ticket.transfer_id] = arg["hold_at"]
                conn.send(("opened", {"digest": _digest(cache, arg["src"])}))
            elif cmd == "cancel":  # too late once its result went out (the id is unknown then)
                late = arg["tid"] not in blocks
                if not late:
                    tr.cancel(arg["tid"])
                    pacing.pop(arg["tid"], None)
                conn.send(("cancelled", {"late": late}))
            elif cmd == "intact":  # are the blocks a failed receive freed still as scribbled?
                freed, want = scribbled[arg["tid"]]
                conn.send(("intact", {"intact": _digest(cache, freed) == want}))
            elif cmd == "busy":  # a long engine step: no transport poll until "wake"
                conn.send(("busy", {}))
                while conn.recv()[0] != "wake":
                    pass  # commands sent to a busy engine are dropped
                conn.send(("awake", {}))
        now = time.monotonic()
        for tid, pace in list(pacing.items()):
            if tid in hold_at and pace[0] >= hold_at[tid]:
                pace[2] = now  # held: the next layer goes the moment it is released
            elif now >= pace[2]:
                tr.send_layer(tid, int(pace[0]))
                handed[tid] += 1
                pace[0], pace[2] = pace[0] + 1, now + pace[1]
                if pace[0] == LAYERS:
                    del pacing[tid]
        for res in tr.poll():
            mine = blocks.pop(res.transfer_id)
            digest = _digest(cache, mine) if res.ok and res.role == "recv" else None
            held.subtract(mine)  # the request finishes (ok) or is abandoned: free once
            if res.role == "send" or not res.ok:  # freed blocks get reused: scribble on them
                for b in (b for b in mine if held[b] == 0):
                    cache.kv[:, b].copy_(torch.randn(cache.kv[:, b].shape, generator=scribble))
            if res.role == "recv" and not res.ok:
                scribbled[res.transfer_id] = (mine, _digest(cache, mine))
            pacing.pop(res.transfer_id, None)
            conn.send(
                (
                    "result",
                    {
                        "tid": res.transfer_id,
                        "ok": res.ok,
                        "error": res.error,
                        "elapsed_s": res.elapsed_s,
                        "digest": digest,
                    },
                )
            )


class Peer:
    """The test's handle on one worker process."""

    def __init__(
        self,
        role: str,
        worker_id: str,
        seed: int = 0,
        head_dim: int = HEAD_DIM,
        shm: bool = False,
        device: str = "cpu",
    ) -> None:
        """`role`: "prefill" (sends), "decode" (receives) or "both" (a worker that does both,
        as after a role switch). `shm`: the transport's same-host data plane (memfd for a CPU
        cache, CUDA IPC for a CUDA one). `device`: where the worker's KV cache lives."""
        ctx = mp.get_context("forkserver")
        self.role, self.worker_id, self.shm = role, worker_id, shm
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main,
            args=(child, role, worker_id, seed, head_dim, shm, device),
            daemon=True,
        )
        self.proc.start()
        self.results: list[dict[str, Any]] = []
        self.port = 0

    def wait_ready(self, timeout_s: float = 60.0) -> Peer:
        self.port = self._next("ready", timeout_s)["port"]
        return self

    def _pump(self, timeout_s: float) -> tuple[str, dict[str, Any]] | None:
        """One message from the worker (results are filed in `self.results`), or None."""
        if not self.conn.poll(timeout_s):
            return None
        kind, payload = self.conn.recv()
        if kind == "result":
            self.results.append(payload)
        return kind, payload

    def _next(self, kind: str, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            got = self._pump(0.01)
            if got is not None and got[0] == kind:
                return dict(got[1])
        raise TimeoutError(f"{self.worker_id}: no {kind!r} within {timeout_s} s")

    def call(self, cmd: str, kind: str, **arg: Any) -> dict[str, Any]:
        self.conn.send((cmd, arg))
        return self._next(kind, 20.0)

    def result(self, tid: str, timeout_s: float) -> dict[str, Any]:
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            for res in self.results:
                if res["tid"] == tid:
                    self.results.remove(res)
                    return res
            self._pump(0.01)
        raise TimeoutError(f"{self.worker_id}: no result for {tid} within {timeout_s} s")

    def signal(self, sig: int) -> None:
        os.kill(self.proc.pid, sig)  # type: ignore[arg-type]

    def kill(self) -> None:
        """SIGKILL by PID and reap (a forkserver child may already be gone)."""
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.proc.pid, signal.SIGKILL)  # type: ignore[arg-type]
        self.proc.join(5.0)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", {}))
                self.proc.join(3.0)
            except (BrokenPipeError, OSError):
                pass
        if self.proc.is_alive():
            self.kill()


def start_transfer(
    d: Peer,
    p: Peer,
    num_tokens: int,
    src: list[int],
    interval_s: float = 0.0,
    timeout_s: float = LONG,
    ascending: bool = False,
    hold_at: int | None = None,
) -> tuple[str, str]:
    """Issue a ticket on `d`, open it on `p`; returns (transfer id, sender's digest).
    `ascending`: consecutive destination blocks, which gloo receives straight into.
    `hold_at`: `p` hands over layers below it only, until `p.call("release", ...)`: a transfer
    that stays mid-stream for as long as the test needs, however slow the machine."""
    ticket = d.call(
        "expect", "ticket", num_tokens=num_tokens, timeout_s=timeout_s, ascending=ascending
    )
    opened = p.call(
        "open", "opened", ticket=ticket, src=src, interval_s=interval_s, hold_at=hold_at
    )
    return str(ticket["transfer_id"]), str(opened["digest"])


def wait_handed(p: Peer, tid: str, layers: int, timeout_s: float = LONG) -> None:
    """Poll the prefill peer until it handed `layers` layers of `tid` to its transport."""
    deadline = time.monotonic() + timeout_s
    while p.call("handed", "handed", tid=tid)["layers"] < layers:
        assert time.monotonic() < deadline, f"{tid}: fewer than {layers} layers handed over"
        time.sleep(0.005)


def wait_landed(d: Peer, p: Peer, tid: str, layer: int, timeout_s: float = LONG) -> None:
    """Poll until layer `layer` of `tid` is in the decode peer's blocks, byte for byte as in
    the prefill peer's (whether or not the receiving thread has counted it yet)."""
    deadline = time.monotonic() + timeout_s
    sent = p.call("layer_digest", "layer_digest", tid=tid, layer=layer)["digest"]
    while d.call("layer_digest", "layer_digest", tid=tid, layer=layer)["digest"] != sent:
        assert time.monotonic() < deadline, f"{tid}: layer {layer} did not land"
        time.sleep(0.005)


def check_exact(d: Peer, p: Peer, tid: str, digest: str) -> None:
    got_d, got_p = d.result(tid, LONG), p.result(tid, LONG)
    assert got_d["ok"] and got_p["ok"], (got_d, got_p)
    assert got_d["digest"] == digest, "decode-side KV differs from the prefill's blocks"


def assert_all_free(*peers: Peer) -> None:
    for peer in peers:
        status = peer.call("status", "status")
        assert status == {"free": BLOCKS, "in_flight": 0}, (peer.worker_id, status)
