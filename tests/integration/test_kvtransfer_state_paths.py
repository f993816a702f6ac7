"""The torch.distributed transport's real behaviour paths walk only legal state moves.

Both ends run in this process over real gloo pairs (127.0.0.1), as in
test_kvtransfer_contract.py; each scenario keeps the `SendTransfer` / `RecvTransfer` the
transport made (white-box) and checks the path it took: it starts in the initial state, every
step is an edge of `SEND_MOVES` / `RECV_MOVES`, and it ends in the final state (a move refused
on a helper thread would end the path early, and be logged as a failed helper job, which the
`no_helper_failures` fixture also catches). Where a path does not depend on timing, the test
names it exactly.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator

import pytest
import torch

from kvtransfer.recv_state import RECV_MOVES, RecvState, RecvTransfer
from kvtransfer.send_state import SEND_MOVES, SendState, SendTransfer
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import TransferResult, new_ticket
from model_runtime.kv_cache import KVCache
from tests.fakes.model_configs import tiny_model_config

LAYERS, BLOCK, BLOCKS = 3, 4, 32
LONG = 30.0  # ticket timeout where nothing is timed (joins may stall for 5 s in the sandbox)
J, ST, GU, FI, SE, DO = (
    SendState.JOINING,
    SendState.STREAMING,
    SendState.GIVEN_UP,
    SendState.FILLING,
    SendState.SENT,
    SendState.DONE,
)
OP, RX, CA, CL, DE, LA = (
    RecvState.OPEN,
    RecvState.RECEIVING,
    RecvState.CANCELLED,
    RecvState.CANCELLED_LANDING,
    RecvState.DECIDED,
    RecvState.LANDING,
)


@pytest.fixture(autouse=True)
def no_helper_failures(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """A helper job that raised (an illegal move included) is logged at ERROR: none may be."""
    caplog.set_level(logging.WARNING, logger="kvtransfer")
    yield
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors


@pytest.fixture(params=[False, True], ids=["gloo", "shm"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[TorchDistTransport, TorchDistTransport]]:
    """(prefill p0, decode d0): the layers' bytes over gloo, or the shared-memory plane; warmed
    up, so every scenario starts on a connected pair."""
    shm = bool(request.param)
    d = TorchDistTransport(cache(None), "d0", connect_timeout_s=LONG, shared_memory=shm)
    p = TorchDistTransport(cache(1), "p0", serve=False, connect_timeout_s=LONG, shared_memory=shm)
    try:
        if shm and not (d.shared_memory and p.shared_memory):
            pytest.skip("shared memory is not available on this host")
        snd, _, _ = start(p, d, [BLOCKS - 1], [BLOCKS - 1], 1)
        assert all(r.ok for r in drive([d, p], 2)), "the warm-up transfer failed"
        check_send(snd, [J, ST, SE, DO])
        yield p, d
    finally:
        p.close()
        d.close()


def cache(seed: int | None) -> KVCache:
    config = tiny_model_config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=LAYERS, head_dim=8
    )
    c = KVCache(config, BLOCKS, BLOCK, torch.float32, model_name="m")
    if seed is not None:
        c.kv.copy_(torch.randn(c.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return c


def start(
    p: TorchDistTransport,
    d: TorchDistTransport,
    src: list[int],
    dst: list[int],
    n_tokens: int,
    layers: int = LAYERS,
    timeout_s: float = LONG,
) -> tuple[SendTransfer, RecvTransfer, str]:
    """Expect + open + hand over the first `layers` layers; both sides' state objects."""
    ticket = new_ticket(d.endpoint, d.layout, "req", dst, n_tokens, timeout_s)
    d.expect(ticket)
    p.open(ticket, src)
    tid = ticket.transfer_id
    snd, rcv = p._sends[tid], d._recvs[tid]
    for layer in range(layers):
        p.send_layer(tid, layer)
    return snd, rcv, tid


def drive(transports: list[TorchDistTransport], want: int) -> list[TransferResult]:
    out: list[TransferResult] = []
    end = time.monotonic() + 2 * LONG
    while len(out) < want and time.monotonic() < end:
        for t in transports:
            out += t.poll()
        time.sleep(0.001)
    assert len(out) == want, out
    return out


def check_send(tr: SendTransfer, *allowed: list[SendState]) -> None:
    """The thread moves to DONE just before its event; a result that went out earlier (a
    cancel, a deadline, close) does not wait for it, so wait here."""
    end = time.monotonic() + LONG
    while tr.state is not DO and time.monotonic() < end:
        time.sleep(0.005)
    assert tr.path[0] is J and tr.path[-1] is DO, tr.path
    assert all(step in SEND_MOVES for step in itertools.pairwise(tr.path)), tr.path
    assert tr.path in allowed, tr.path


def check_recv(tr: RecvTransfer, *allowed: list[RecvState]) -> None:
    assert tr.path[0] is OP and tr.path[-1] is DE, tr.path
    assert all(step in RECV_MOVES for step in itertools.pairwise(tr.path)), tr.path
    assert tr.path in allowed, tr.path


def is_shm(d: TorchDistTransport) -> bool:
    return d.shared_memory


@pytest.mark.parametrize(
    ("src", "dst"),
    [([7, 2], [3, 9]), ([4, 5], [10, 11])],
    ids=["copied_into_staging", "zero_copy_into_the_blocks"],
)
def test_a_completed_transfer(
    pair: tuple[TorchDistTransport, TorchDistTransport], src: list[int], dst: list[int]
):
    p, d = pair
    snd, rcv, _ = start(p, d, src, dst, 2 * BLOCK)
    assert all(r.ok for r in drive([d, p], 2))
    check_send(snd, [J, ST, SE, DO])
    direct = dst == [10, 11] and not is_shm(d)  # gloo receives straight into the blocks
    check_recv(rcv, [OP, RX, OP, DE] if direct else [OP, DE])


def test_a_sender_cancel_mid_stream(pair: tuple[TorchDistTransport, TorchDistTransport]):
    """Announced (the usual case): the thread fills the stream; else it pushes a cancel
    record and stops. A copied transfer's result goes out at the next poll, which gives the
    engine's posting up too (GIVEN_UP) unless the thread was already filling or done."""
    p, d = pair
    snd, rcv, tid = start(p, d, [6, 1], [5, 8], 2 * BLOCK, layers=1)
    time.sleep(0.05)
    p.cancel(tid)
    results = drive([d, p], 2)
    assert not any(r.ok for r in results)
    filled, unannounced = [J, ST, FI, SE, DO], [J, DO]
    check_send(snd, filled, [J, ST, GU, FI, SE, DO], unannounced, [J, GU, DO])
    check_recv(rcv, [OP, DE])


def test_a_receiver_cancel_mid_stream(pair: tuple[TorchDistTransport, TorchDistTransport]):
    """Received straight into the blocks (gloo): cancelled while they may land, reported once
    they settled — whichever of the poll and the settling comes first."""
    p, d = pair
    snd, rcv, tid = start(p, d, [12, 13], [20, 21], 2 * BLOCK, layers=1)
    time.sleep(0.05)
    d.cancel(tid)
    for layer in range(1, LAYERS):  # the sender, unaware, finishes its stream
        p.send_layer(tid, layer)
    results = drive([d, p], 2)
    assert not any(r.ok for r in results)
    check_send(snd, [J, ST, SE, DO])
    before_header = [OP, CA, DE]  # only if the header was slower than 50 ms
    if is_shm(d):
        check_recv(rcv, before_header)
    else:
        check_recv(rcv, [OP, RX, CL, CA, DE], [OP, RX, CL, LA, DE], before_header)


def test_the_engines_deadline_while_a_layer_is_missing(
    pair: tuple[TorchDistTransport, TorchDistTransport],
):
    """The sending engine stops after one layer: its poll gives up at the deadline, or its
    thread sees the deadline first; either way the thread fills the stream (the pair goes
    on)."""
    p, d = pair
    snd, rcv, _ = start(p, d, [14, 15], [22, 23], 2 * BLOCK, layers=1, timeout_s=0.5)
    results = drive([d, p], 2)
    assert not any(r.ok for r in results)
    check_send(snd, [J, ST, GU, FI, SE, DO], [J, ST, FI, SE, DO])
    if is_shm(d):
        check_recv(rcv, [OP, DE])
    else:  # decided at the deadline while the receives may land, or after they failed
        check_recv(rcv, [OP, RX, LA, DE], [OP, RX, OP, DE])


def test_close_gives_up_a_transfer_in_flight(pair: tuple[TorchDistTransport, TorchDistTransport]):
    """Closed in flight: the sender streams (announced, layer 0 posted), the receiver claimed
    the transfer and wrote layer 0, layers 1-2 are not handed over yet — a state the test
    waits for, whatever the machine's speed (a sleep stood in for it once)."""
    p, d = pair
    snd, rcv, _ = start(p, d, [16, 3], [24, 2], 2 * BLOCK, layers=1)
    end = time.monotonic() + LONG
    while not (snd.state is ST and rcv.sender is not None and rcv.layers_written >= 1):
        assert time.monotonic() < end, (snd.path, rcv.path, rcv.layers_written)
        time.sleep(0.005)
    p.close()
    d.close()
    results = drive([d, p], 2)
    assert {r.error for r in results} == {"transport closed"}, results
    check_send(snd, [J, ST, GU, DO])
    check_recv(rcv, [OP, DE])


@pytest.mark.parametrize("how", ["deadline", "sender_cancel", "receiver_cancel"])
def test_one_transfers_end_leaves_the_pair_and_its_other_transfers_alone(
    pair: tuple[TorchDistTransport, TorchDistTransport], how: str
):
    """Two transfers share the pair; one ends mid-stream by its own deadline or a cancel,
    while the other is held (a layer not handed over yet). The other then completes with the
    exact bytes, on the same pair (no re-join), and the pair carries a third transfer."""
    p, d = pair
    gen = p._sender._pairs[d.endpoint.key()].gen
    ended_timeout = 0.3 if how == "deadline" else LONG
    # Consecutive destination blocks: the receives go straight into the blocks (gloo).
    _, _, ended = start(p, d, [4, 5], [10, 11], 2 * BLOCK, layers=1, timeout_s=ended_timeout)
    _, _, kept = start(p, d, [6, 7], [12, 13], 2 * BLOCK, layers=1)
    if how == "sender_cancel":
        p.cancel(ended)
    elif how == "receiver_cancel":
        d.cancel(ended)
        for layer in range(1, LAYERS):  # the sender, unaware, finishes its stream
            p.send_layer(ended, layer)
    first = drive([d, p], 2)  # both sides of the ended transfer; the kept one is held
    assert {r.transfer_id for r in first} == {ended}, first
    assert not any(r.ok for r in first), first
    for layer in range(1, LAYERS):
        p.send_layer(kept, layer)
    second = drive([d, p], 2)
    assert [r.ok for r in second] == [True, True], second
    assert torch.equal(d._cache.kv[:, 12:14], p._cache.kv[:, 6:8])
    assert p._sender._pairs[d.endpoint.key()].gen == gen, "the pair was re-joined"
    start(p, d, [8, 9], [14, 15], 2 * BLOCK)
    assert all(r.ok for r in drive([d, p], 2))
    assert torch.equal(d._cache.kv[:, 14:16], p._cache.kv[:, 8:10])
    assert p._sender._pairs[d.endpoint.key()].gen == gen, "the pair was re-joined"


def test_close_ends_helper_threads_blocked_on_the_wire(
    pair: tuple[TorchDistTransport, TorchDistTransport],
):
    """A receiving thread blocked in a wait for a layer the sender has not handed over (its
    bound is the exchange bound, seconds away) returns at once when its transport closes:
    close tears the pairs down, so a stopping worker does not wait on it."""
    p, d = pair
    _, rcv, _ = start(p, d, [16, 17], [24, 25], 2 * BLOCK, layers=1)
    wait_for(lambda: rcv.io_started, "the header was never accepted")
    d.close()
    wait_for(lambda: d._receiver is not None and d._receiver._helpers._pending == 0, "stuck")
    p.close()
    wait_for(lambda: p._sender._helpers._pending == 0, "a sending thread is still running")


def wait_for(pred: Callable[[], bool], what: str, timeout_s: float = 2.0) -> None:
    end = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < end, what
        time.sleep(0.005)
