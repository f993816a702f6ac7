"""KV transfer between real processes over gloo: exactness, concurrency, SIGKILL / SIGSTOP.

The workers are `tests.fakes.kv_workers` processes (a small engine loop each, with a block
ledger and a digest of the KV it sent or received).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator

import pytest

from kvtransfer.wire import PEER_SLACK_S
from tests.fakes.kv_workers import (
    BLOCK,
    LAYERS,
    LONG,
    Peer,
    assert_all_free,
    check_exact,
    start_transfer,
    wait_handed,
    wait_landed,
)

pytestmark = pytest.mark.slow

DEADLINE_S = 2.0  # the faulted transfer's deadline: the bound under test


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
    straight into the blocks (gloo) or gets notifications (shared memory). Receives into the
    blocks hold the result (so the blocks) until the exchange bound: a frozen sender is told
    from a slow one only `PEER_SLACK_S` past the sender's deadline (`kvtransfer.wire`)."""
    d, p = cluster["d0"], cluster["p0"]
    tid, digest = start_transfer(d, p, 9 * BLOCK, list(range(10, 19)))
    check_exact(d, p, tid, digest)  # the pair is established and healthy
    # The fault lands between layer 1 and layer 2: the prefill peer holds layer 2 until it has
    # reported two layers handed over and the fault is in; a surviving sender then hands it on.
    tid, _ = start_transfer(
        d, p, 9 * BLOCK, list(range(20, 29)), 0.0, DEADLINE_S, ascending=victim == "p0", hold_at=2
    )
    wait_handed(p, tid, 2)
    cluster[victim].signal(sig)
    faulted = time.monotonic()
    if victim == "d0":
        p.call("release", "released", tid=tid)
    survivor = p if victim == "d0" else d
    res = survivor.result(tid, DEADLINE_S + 5.0)
    noticed = time.monotonic() - faulted
    assert not res["ok"], res
    slack = PEER_SLACK_S if victim == "p0" and sig == signal.SIGSTOP and not d.shm else 0.0
    assert res["elapsed_s"] <= DEADLINE_S + slack + 1.0, res  # counted from expect / open
    assert noticed <= DEADLINE_S + slack + 1.0, noticed
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
            wait_handed(p, ticket["transfer_id"], LAYERS)  # the sends are stuck
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
    d.call("busy", "busy")  # its engine polls nothing until woken
    opened = p.call("open", "opened", ticket=ticket, src=[3, 9, 14, 27, 33], interval_s=0.0)
    got_p = p.result(ticket["transfer_id"], LONG)
    assert got_p["ok"], got_p  # while d's engine is still busy
    d.call("wake", "awake")
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
        # The cancel lands once layer 0 is in the blocks; the sender holds layers 1 and 2 until
        # the test has seen that no result comes out while they are still to land.
        tid, _ = start_transfer(d, p, 4 * BLOCK, [4, 5, 6, 7], ascending=True, hold_at=1)
        wait_landed(d, p, tid, 0)
        assert not d.call("cancel", "cancelled", tid=tid)["late"]
        with pytest.raises(TimeoutError):
            d.result(tid, 0.5)  # reported before the stream was done
        p.call("release", "released", tid=tid)
        got_d = d.result(tid, LONG)
        assert not got_d["ok"] and got_d["error"] == "cancelled by receiver", got_d
        assert not p.result(tid, LONG)["ok"]
        time.sleep(0.2)  # room for a (wrong) late layer to land before the check
        assert d.call("intact", "intact", tid=tid)["intact"], "a layer landed after the result"
        assert_all_free(d, p)
        tid, digest = start_transfer(d, p, 4 * BLOCK, [8, 9, 10, 11], ascending=True)
        check_exact(d, p, tid, digest)
    finally:
        d.stop()
        p.stop()
