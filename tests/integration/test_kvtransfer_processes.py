"""KV transfer between real processes over gloo: exactness, concurrency, SIGKILL / SIGSTOP.

Each worker is a spawned process running `_worker_main`: a small engine loop that owns a
`KVCache`, a `TorchDistTransport` and a block ledger, takes commands from the test over a pipe
and reports transfer results (with a SHA-256 of the KV it sent or received, so the test compares
bytes without shipping tensors). Blocks are held by the rules of `kvtransfer.base`: the decode
side from `expect` until the result, the prefill side from `open` until the result; the ledger's
free count must come back to `BLOCKS` after any fault. A prefill worker scribbles over source
blocks the moment it frees them, as a reused block would be, so a transfer that still read
them after its result would show up as a wrong digest. Processes are stopped by PID.
"""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing as mp
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from multiprocessing.connection import Connection
from typing import Any

import pytest
import torch

from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import TransferTicket, blocks_needed, new_ticket
from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache

pytestmark = pytest.mark.slow

# Workers fork from a server that has already imported torch: a fresh `spawn` re-imports it
# for every worker, which costs seconds each on a busy 2-core machine.
mp.get_context("forkserver").set_forkserver_preload(
    ["torch", "kvtransfer.torch_dist", "model_runtime.kv_cache"]
)

LAYERS, BLOCK, BLOCKS, HEADS, HEAD_DIM = 3, 4, 64, 2, 8
DEADLINE_S = 2.0  # the faulted transfer's deadline: the bound under test
LONG = 30.0  # every other transfer's (joins may meet the sandbox's 5 s connect stalls)


def _cache(seed: int | None, head_dim: int = HEAD_DIM) -> KVCache:
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
    cache = KVCache(cfg, BLOCKS, BLOCK, torch.float32, model_name="m")
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def _digest(cache: KVCache, blocks: list[int]) -> str:
    h = hashlib.sha256()
    for layer in range(LAYERS):
        h.update(cache.gather_layer(layer, blocks).numpy().tobytes())
    return h.hexdigest()


def _worker_main(
    conn: Connection, role: str, worker_id: str, seed: int, head_dim: int, shm: bool
) -> None:
    """One worker process: engine loop over commands, transport polls and layer pacing."""
    cache = _cache(seed if role != "decode" else None, head_dim)
    scribble = torch.Generator().manual_seed(seed + 1000)
    tr = TorchDistTransport(
        cache, worker_id, serve=role != "prefill", connect_timeout_s=LONG, shared_memory=shm
    )
    held: Counter[int] = Counter()
    blocks: dict[str, list[int]] = {}  # transfer id -> blocks held for it
    pacing: dict[str, list[float]] = {}  # transfer id -> [next layer, interval, next time]
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
            elif cmd == "busy":  # a long engine step: no transport poll meanwhile
                conn.send(("busy", {}))
                time.sleep(arg["seconds"])
        now = time.monotonic()
        for tid, pace in list(pacing.items()):
            if now >= pace[2]:
                tr.send_layer(tid, int(pace[0]))
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
    ) -> None:
        """`role`: "prefill" (sends), "decode" (receives) or "both" (a worker that does both,
        as after a role switch). `shm`: the transport's same-host shared-memory data plane."""
        ctx = mp.get_context("forkserver")
        self.role, self.worker_id, self.shm = role, worker_id, shm
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(
            target=_worker_main, args=(child, role, worker_id, seed, head_dim, shm), daemon=True
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


@pytest.fixture(scope="module", params=[False, True], ids=["gloo", "shm"])
def cluster(request: pytest.FixtureRequest) -> Iterator[dict[str, Peer]]:
    """d0 (decode) and p0 (prefill), started together; tests replace the ones they kill.
    Run once with the layers' bytes over gloo, once with the shared-memory data plane."""
    shm = bool(request.param)
    peers = {"d0": Peer("decode", "d0", shm=shm), "p0": Peer("prefill", "p0", seed=1, shm=shm)}
    for peer in peers.values():
        peer.wait_ready()
    yield peers
    for peer in peers.values():
        peer.stop()


def start_transfer(
    d: Peer,
    p: Peer,
    num_tokens: int,
    src: list[int],
    interval_s: float = 0.0,
    timeout_s: float = LONG,
    ascending: bool = False,
) -> tuple[str, str]:
    """Issue a ticket on `d`, open it on `p`; returns (transfer id, sender's digest).
    `ascending`: consecutive destination blocks, which gloo receives straight into."""
    ticket = d.call(
        "expect", "ticket", num_tokens=num_tokens, timeout_s=timeout_s, ascending=ascending
    )
    opened = p.call("open", "opened", ticket=ticket, src=src, interval_s=interval_s)
    return str(ticket["transfer_id"]), str(opened["digest"])


def check_exact(d: Peer, p: Peer, tid: str, digest: str) -> None:
    got_d, got_p = d.result(tid, LONG), p.result(tid, LONG)
    assert got_d["ok"] and got_p["ok"], (got_d, got_p)
    assert got_d["digest"] == digest, "decode-side KV differs from the prefill's blocks"


def assert_all_free(*peers: Peer) -> None:
    for peer in peers:
        status = peer.call("status", "status")
        assert status == {"free": BLOCKS, "in_flight": 0}, (peer.worker_id, status)


def test_many_concurrent_transfers_all_exact(cluster: dict[str, Peer]):
    """Several prefill workers into one decode worker, one prefill worker into several decode
    workers, 16 transfers in flight, layers paced to interleave. w2 both sends and receives."""
    w2 = Peer("both", "w2", seed=2, shm=cluster["d0"].shm).wait_ready()
    try:
        d0, p0 = cluster["d0"], cluster["p0"]
        cases = [  # (tokens, source blocks): 1 token, one block, many blocks, prefix hit
            (1, [3]),
            (BLOCK, [9]),
            (7 * BLOCK + 2, [20, 5, 31, 2, 37, 8, 13, 30]),
            (3 * BLOCK, [20, 5, 39]),  # shares cached blocks 20, 5 with the previous prompt
        ]
        pairs = [(d0, p0), (d0, w2), (w2, p0), (d0, p0)]  # (receiver, sender)
        started = [  # half received through staging buffers, half straight into the blocks
            (d, p, *start_transfer(d, p, n, src, interval_s=0.01, ascending=k % 2 == 1))
            for k, (d, p) in enumerate(pairs)
            for n, src in cases
        ]
        for d, p, tid, digest in started:
            check_exact(d, p, tid, digest)
        assert_all_free(d0, p0, w2)
        # Same host: with shared memory on, every pair really reads in place.
        want = ["d0", "w2"] if d0.shm else []
        assert p0.call("shm_peers", "shm_peers")["peers"] == want
        assert w2.call("shm_peers", "shm_peers")["peers"] == want[:1]
    finally:
        w2.stop()


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["sigkill", "sigstop"])
@pytest.mark.parametrize("victim", ["p0", "d0"])
def test_peer_fault_mid_transfer(cluster: dict[str, Peer], victim: str, sig: int):
    """The survivor fails the transfer within its deadline, frees its blocks, and a new
    transfer with a restarted peer works. A surviving receiver has posted its receives
    straight into the blocks (gloo) or gets notifications (shared memory)."""
    d, p = cluster["d0"], cluster["p0"]
    tid, digest = start_transfer(d, p, 9 * BLOCK, list(range(10, 19)))
    check_exact(d, p, tid, digest)  # the pair is established and healthy
    # Layers every 0.4 s: the fault lands between layer 1 and layer 2.
    tid, _ = start_transfer(
        d, p, 9 * BLOCK, list(range(20, 29)), 0.4, DEADLINE_S, ascending=victim == "p0"
    )
    time.sleep(0.6)
    cluster[victim].signal(sig)
    faulted = time.monotonic()
    survivor = p if victim == "d0" else d
    res = survivor.result(tid, DEADLINE_S + 5.0)
    noticed = time.monotonic() - faulted
    assert not res["ok"], res
    assert res["elapsed_s"] <= DEADLINE_S + 1.0, res  # counted from expect / open
    assert noticed <= DEADLINE_S + 1.0, noticed
    assert_all_free(survivor)
    # Restart the victim under the same worker id; the next transfer re-joins and works.
    cluster[victim].kill()
    role, seed = ("decode", 0) if victim == "d0" else ("prefill", 1)
    cluster[victim] = Peer(role, victim, seed=seed, shm=cluster["d0"].shm).wait_ready()
    d, p = cluster["d0"], cluster["p0"]
    tid, digest = start_transfer(d, p, 5 * BLOCK + 1, [40, 41, 42, 43, 44, 45])
    check_exact(d, p, tid, digest)
    assert_all_free(d, p)


BIG_HEAD_DIM = 4096  # 256 KB per block and layer: a 48-block layer overflows socket buffers


@pytest.mark.parametrize("shm", [False, True], ids=["gloo", "shm"])
def test_cancelled_zero_copy_send_holds_its_blocks_until_its_sends_are_done(shm: bool):
    """Consecutive source blocks go out straight from the cache (gloo), or the receiver reads
    them in place (shared memory). Cancelled while the receiver is frozen, the sender reports
    the result — which frees, and here scribbles over, the blocks — only once its sends are
    done (shared memory: acknowledged) or at the deadline; and the receiver never completes a
    transfer with bytes read after that."""
    d = Peer("decode", "bd", head_dim=BIG_HEAD_DIM, shm=shm)
    p = Peer("prefill", "bp", seed=3, head_dim=BIG_HEAD_DIM, shm=shm)
    try:
        d.wait_ready()
        p.wait_ready()
        tid, digest = start_transfer(d, p, 2 * BLOCK, [0, 1])
        check_exact(d, p, tid, digest)  # the pair is established
        ticket = d.call("expect", "ticket", num_tokens=48 * BLOCK, timeout_s=DEADLINE_S)
        d.signal(signal.SIGSTOP)
        try:
            p.call("open", "opened", ticket=ticket, src=list(range(48)), interval_s=0.0)
            time.sleep(0.2)  # every layer handed over; the sends are stuck
            assert not p.call("cancel", "cancelled", tid=ticket["transfer_id"])["late"]
            cancelled = time.monotonic()
            with pytest.raises(TimeoutError):
                p.result(ticket["transfer_id"], 0.5)
            res = p.result(ticket["transfer_id"], DEADLINE_S + 5.0)
            assert not res["ok"] and time.monotonic() - cancelled <= DEADLINE_S + 1.0, res
        finally:
            d.signal(signal.SIGCONT)
        assert not d.result(ticket["transfer_id"], DEADLINE_S + 5.0)["ok"]
        assert_all_free(d, p)
        # Cancelled right after its last layer, on a live pair: the receiver either fails it
        # or holds exactly the blocks' content at open (never the scribble).
        for _ in range(3):
            tid, digest = start_transfer(d, p, 48 * BLOCK, list(range(8, 56)))
            late = p.call("cancel", "cancelled", tid=tid)["late"]
            got_p, got_d = p.result(tid, LONG), d.result(tid, LONG)
            assert got_p["ok"] == late, (late, got_p)  # ok only if it finished before the cancel
            assert not got_d["ok"] or got_d["digest"] == digest, got_d
        tid, digest = start_transfer(d, p, 48 * BLOCK, list(range(8, 56)))
        check_exact(d, p, tid, digest)
        assert_all_free(d, p)
    finally:
        d.stop()
        p.stop()


def test_sender_hears_ok_while_the_receiving_engine_is_busy(cluster: dict[str, Peer]):
    """The acknowledgement comes from the receiving thread once every layer is written, not
    from the decode engine's next poll: a prefill worker is not held up by a long decode step."""
    d, p = cluster["d0"], cluster["p0"]
    tid, digest = start_transfer(d, p, 3 * BLOCK, [50, 51, 52])
    check_exact(d, p, tid, digest)  # the pair is established
    ticket = d.call("expect", "ticket", num_tokens=5 * BLOCK, timeout_s=LONG)
    d.call("busy", "busy", seconds=3.0)
    began = time.monotonic()
    opened = p.call("open", "opened", ticket=ticket, src=[3, 9, 14, 27, 33], interval_s=0.0)
    got_p = p.result(ticket["transfer_id"], LONG)
    assert got_p["ok"] and time.monotonic() - began < 2.0, got_p  # d still busy then
    got_d = d.result(ticket["transfer_id"], LONG)
    assert got_d["ok"] and got_d["digest"] == opened["digest"], got_d
    assert_all_free(d, p)


def test_a_cancelled_direct_receive_reports_only_once_its_receives_are_done():
    """Received straight into the blocks (gloo, consecutive destination blocks), a transfer the
    decode side cancels mid-stream reports its result — which frees, and here scribbles over,
    the blocks — only once the rest of the stream has landed, so no late layer overwrites a
    freed block."""
    d = Peer("decode", "cd").wait_ready()
    p = Peer("prefill", "cp", seed=4).wait_ready()
    try:
        tid, digest = start_transfer(d, p, 2 * BLOCK, [0, 1], ascending=True)
        check_exact(d, p, tid, digest)  # the pair is established
        # Layers 0.3 s apart: the cancel lands after layer 0, layers 1 and 2 are still to come.
        tid, _ = start_transfer(d, p, 4 * BLOCK, [4, 5, 6, 7], interval_s=0.3, ascending=True)
        time.sleep(0.1)
        assert not d.call("cancel", "cancelled", tid=tid)["late"]
        cancelled = time.monotonic()
        got_d = d.result(tid, LONG)
        assert not got_d["ok"] and got_d["error"] == "cancelled by receiver", got_d
        assert time.monotonic() - cancelled >= 0.2, "reported before the stream was done"
        assert not p.result(tid, LONG)["ok"]
        time.sleep(0.2)
        assert d.call("intact", "intact", tid=tid)["intact"], "a layer landed after the result"
        assert_all_free(d, p)
        tid, digest = start_transfer(d, p, 4 * BLOCK, [8, 9, 10, 11], ascending=True)
        check_exact(d, p, tid, digest)
    finally:
        d.stop()
        p.stop()
