"""The KV-transport contract, run against both implementations in one process.

`loopback` hands tensors across in memory; `torch_dist` runs real gloo pairs over 127.0.0.1
(stores, joins, helper threads), with both ends in this process. Real-process faults (SIGKILL,
SIGSTOP) are in test_kvtransfer_processes.py.

Deadlines are generous (`LONG`) wherever a pair may still be connecting: in the gVisor sandbox
about one TCPStore client connect in 25 stalls for 5 s (kernel-level, also outside pdserve).
Tests that time something warm the pair up first (`warm_up`), so no connect is inside the
measured part.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest
import torch

from kvtransfer.base import KVTransport
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import (
    LayoutMismatchError,
    TransferResult,
    TransferTicket,
    new_ticket,
)
from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache
from tests.fakes.model_configs import tiny_model_config

LAYERS, BLOCK, BLOCKS = 3, 4, 48
LONG = 30.0  # ticket timeout (s) where nothing is timed


def model_config(head_dim: int = 8) -> ModelConfig:
    return tiny_model_config(
        vocab_size=64,
        hidden_size=4 * head_dim,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        head_dim=head_dim,
        max_position_embeddings=256,
    )


def make_cache(seed: int | None, block_size: int = BLOCK, head_dim: int = 8) -> KVCache:
    cache = KVCache(model_config(head_dim), BLOCKS, block_size, torch.float32, model_name="m")
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


Factory = Callable[[str, KVCache, bool], KVTransport]


@pytest.fixture(params=["loopback", "torch_dist"])
def factory(request: pytest.FixtureRequest) -> Iterator[Factory]:
    made: list[KVTransport] = []
    hub = LoopbackHub()

    def make(worker_id: str, cache: KVCache, serve: bool) -> KVTransport:
        t: KVTransport
        if request.param == "loopback":
            t = LoopbackTransport(hub, worker_id, cache)
        else:
            t = TorchDistTransport(cache, worker_id, serve=serve, connect_timeout_s=LONG)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def drive(
    transports: Sequence[KVTransport], want: int, timeout_s: float = 2 * LONG
) -> list[TransferResult]:
    """Poll until `want` results arrived (want=0: for all of `timeout_s`); none twice."""
    out: list[TransferResult] = []
    end = time.monotonic() + timeout_s
    while (want == 0 or len(out) < want) and time.monotonic() < end:
        for t in transports:
            out += t.poll()
        time.sleep(0.001)
    assert len(out) == want, f"got {len(out)} results, wanted {want}: {out}"
    seen = Counter((r.transfer_id, r.epoch, r.role) for r in out)
    assert max(seen.values(), default=1) == 1, f"a result was reported twice: {seen}"
    return out


def transfer(
    src_t: KVTransport,
    dst_t: KVTransport,
    src: list[int],
    dst: list[int],
    n_tokens: int,
    timeout_s: float = LONG,
) -> TransferTicket:
    """Expect + open + send every layer (the results are left for the caller to drive)."""
    ticket = new_ticket(dst_t.endpoint, dst_t.layout, "req", dst, n_tokens, timeout_s)
    dst_t.expect(ticket)
    src_t.open(ticket, src)
    for layer in range(LAYERS):
        src_t.send_layer(ticket.transfer_id, layer)
    return ticket


def warm_up(src_t: KVTransport, dst_t: KVTransport) -> None:
    """One transfer, so the pair is connected before a test times anything."""
    transfer(src_t, dst_t, [BLOCKS - 1], [BLOCKS - 1], 1)
    assert all(r.ok for r in drive([src_t, dst_t], 2))


def assert_same_kv(sc: KVCache, src: list[int], dc: KVCache, dst: list[int]) -> None:
    for layer in range(LAYERS):
        a, b = sc.gather_layer(layer, src), dc.gather_layer(layer, dst[: len(src)])
        assert torch.equal(a, b), f"layer {layer}: max diff {(a - b).abs().max().item()}"


@pytest.mark.parametrize(
    ("n_tokens", "src", "dst"),
    [
        (1, [7], [3]),  # a one-token prompt
        (BLOCK, [5], [9]),  # exactly one block
        (6 * BLOCK + 3, [40, 2, 17, 5, 33, 8, 21], [0, 1, 2, 3, 4, 5, 6, 30, 31]),  # many
    ],
    ids=["one_token", "one_block", "many_blocks"],
)
def test_kv_arrives_bit_exact(factory: Factory, n_tokens: int, src: list[int], dst: list[int]):
    sc, dc = make_cache(1), make_cache(None)
    d, p = factory("d0", dc, True), factory("p0", sc, False)
    ticket = transfer(p, d, src, dst, n_tokens)
    results = drive([d, p], 2)
    assert all(r.ok for r in results), results
    assert {r.role for r in results} == {"send", "recv"}
    assert_same_kv(sc, src, dc, dst)
    # Headroom blocks beyond the prompt and every other block stay untouched.
    written = set(dst[: ticket.num_blocks])
    untouched = [b for b in range(BLOCKS) if b not in written]
    assert torch.count_nonzero(dc.kv[:, untouched]) == 0
    assert drive([d, p], 0, timeout_s=0.05) == []


def test_prefix_cache_hits_on_sender_are_sent(factory: Factory):
    """Two prompts share cached prefix blocks 11, 4 on the sender; both arrive whole."""
    sc, dc = make_cache(2), make_cache(None)
    d, p = factory("d0", dc, True), factory("p0", sc, False)
    a_src, b_src = [11, 4, 20], [11, 4, 9, 30]
    a_dst, b_dst = [0, 1, 2], [5, 6, 7, 8]
    transfer(p, d, a_src, a_dst, 3 * BLOCK)
    transfer(p, d, b_src, b_dst, 3 * BLOCK + 1)
    assert all(r.ok for r in drive([d, p], 4))
    assert_same_kv(sc, a_src, dc, a_dst)
    assert_same_kv(sc, b_src, dc, b_dst)


def test_concurrent_interleaved_transfers(factory: Factory):
    """Two senders into one receiver and one sender into two receivers, layers interleaved."""
    s0, s1, r0, r1 = make_cache(3), make_cache(4), make_cache(None), make_cache(None)
    p0, p1 = factory("p0", s0, False), factory("p1", s1, False)
    d0, d1 = factory("d0", r0, True), factory("d1", r1, True)
    plan = [  # (sender, its cache, receiver, its cache, src, dst, tokens)
        (p0, s0, d0, r0, [1, 2, 3], [10, 11, 12], 10),
        (p0, s0, d0, r0, [4, 5], [13, 14], 5),
        (p1, s1, d0, r0, [6, 7, 8, 9], [15, 16, 17, 18], 16),
        (p0, s0, d1, r1, [30, 31], [0, 1], 8),
        (p1, s1, d1, r1, [32], [2], 1),
    ]
    tickets = []
    for snd, _, rcv, _, src, dst, n in plan:
        ticket = new_ticket(rcv.endpoint, rcv.layout, "req", dst, n, LONG)
        rcv.expect(ticket)
        snd.open(ticket, src)
        tickets.append(ticket)
    for layer in range(LAYERS):
        for (snd, *_), ticket in zip(plan, tickets, strict=True):
            snd.send_layer(ticket.transfer_id, layer)
    results = drive([p0, p1, d0, d1], 2 * len(plan))
    assert all(r.ok for r in results), [r for r in results if not r.ok]
    for _, sc, _, rc, src, dst, _ in plan:
        assert_same_kv(sc, src, rc, dst)


def test_layout_mismatch_names_both_values(factory: Factory):
    d = factory("d0", make_cache(None), True)
    p = factory("p0", make_cache(1, block_size=8, head_dim=16), False)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0, 1], 8, LONG)
    with pytest.raises(LayoutMismatchError) as info:
        p.open(ticket, [0])
    msg = str(info.value)
    assert "block_size: 8 (prefill p0) != 4 (decode d0)" in msg, msg
    assert "head_dim: 16 (prefill p0) != 8 (decode d0)" in msg, msg


def test_receiver_deadline_without_sender(factory: Factory):
    d = factory("d0", make_cache(None), True)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0], 2, 0.3)
    d.expect(ticket)
    (res,) = drive([d], 1, timeout_s=2.0)
    assert not res.ok and "deadline of 300 ms" in (res.error or "")
    assert 0.3 <= res.elapsed_s <= 0.3 + 0.5, res.elapsed_s


def test_unknown_ticket_is_rejected_fast(factory: Factory):
    d, p = factory("d0", make_cache(None), True), factory("p0", make_cache(1), False)
    warm_up(p, d)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0], 2, LONG)  # never expected
    p.open(ticket, [3])
    for layer in range(LAYERS):
        p.send_layer(ticket.transfer_id, layer)
    (res,) = drive([d, p], 1)
    assert not res.ok and res.role == "send" and "no live ticket" in (res.error or "")
    assert res.elapsed_s < 2.0


def test_stale_epoch_is_rejected_and_new_epoch_works(factory: Factory):
    sc, dc = make_cache(5), make_cache(None)
    d, p = factory("d0", dc, True), factory("p0", sc, False)
    old = new_ticket(d.endpoint, d.layout, "req", [0, 1], 6, LONG, transfer_id="t1", epoch=0)
    d.expect(old)
    d.cancel("t1")
    (res,) = drive([d], 1)
    assert not res.ok and res.error == "cancelled by receiver"
    new = new_ticket(d.endpoint, d.layout, "req", [2, 3], 6, LONG, transfer_id="t1", epoch=1)
    d.expect(new)
    p.open(old, [8, 9])  # a sender still holding the old ticket streams its layers ...
    for layer in range(LAYERS):
        p.send_layer("t1", layer)
    (res,) = drive([d, p], 1)  # ... and is told no by the acknowledgement
    assert not res.ok and res.role == "send" and "stale epoch" in (res.error or "")
    p.open(new, [8, 9])
    for layer in range(LAYERS):
        p.send_layer("t1", layer)
    assert all(r.ok and r.epoch == 1 for r in drive([d, p], 2))
    assert_same_kv(sc, [8, 9], dc, [2, 3])


@pytest.mark.parametrize("side", ["receiver", "sender", "sender_before_any_layer"])
def test_cancel_mid_transfer_fails_both_sides_once(factory: Factory, side: str):
    sc, dc = make_cache(6), make_cache(None)
    d, p = factory("d0", dc, True), factory("p0", sc, False)
    warm_up(p, d)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0, 1], 8, LONG)
    d.expect(ticket)
    p.open(ticket, [4, 5])
    if side != "sender_before_any_layer":
        p.send_layer(ticket.transfer_id, 0)
        time.sleep(0.05)
    (d if side == "receiver" else p).cancel(ticket.transfer_id)
    if side == "receiver":
        for layer in range(1, LAYERS):  # the sender, unaware, finishes its stream
            p.send_layer(ticket.transfer_id, layer)
    results = drive([d, p], 2)
    assert not any(r.ok for r in results)
    assert all(r.elapsed_s < 2.0 for r in results), results  # long before the deadline
    if side == "sender":  # the receiver heard it from the stream itself (torch: its trailer)
        assert [r.error for r in results if r.role == "recv"] == ["cancelled by sender"], results
    # The pair is still good for the next transfer.
    transfer(p, d, [6, 7], [2, 3], 8)
    assert all(r.ok for r in drive([d, p], 2))
    assert_same_kv(sc, [6, 7], dc, [2, 3])


def test_validation_errors(factory: Factory):
    d, p = factory("d0", make_cache(None), True), factory("p0", make_cache(1), False)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0, 1], 8, LONG)
    d.expect(ticket)
    with pytest.raises(ValueError, match="already expected"):
        d.expect(ticket)
    with pytest.raises(ValueError, match="1 source blocks given"):
        p.open(ticket, [1])
    with pytest.raises(ValueError, match="outside the cache"):
        p.open(ticket, [1, BLOCKS])
    p.open(ticket, [1, 2])
    with pytest.raises(ValueError, match="expected 0"):
        p.send_layer(ticket.transfer_id, 1)
    with pytest.raises(ValueError, match="unknown transfer id"):
        p.send_layer("nope", 0)
    with pytest.raises(ValueError, match="unknown transfer id"):
        d.cancel("nope")
    with pytest.raises(ValueError, match="needs 3"):
        new_ticket(d.endpoint, d.layout, "req", [0, 1], 9, LONG)
    other = new_ticket(p.endpoint, d.layout, "req", [0], 1, LONG)
    with pytest.raises(ValueError, match="addressed to"):
        d.expect(other)


def test_receiver_close_fails_sender_by_its_deadline(factory: Factory):
    d, p = factory("d0", make_cache(None), True), factory("p0", make_cache(1), False)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0], 3, 1.0)
    d.expect(ticket)
    p.open(ticket, [2])
    p.send_layer(ticket.transfer_id, 0)
    time.sleep(0.05)
    d.close()
    results = drive([d, p], 2, timeout_s=3.0)
    assert not any(r.ok for r in results)
    assert all(r.elapsed_s <= 1.0 + 0.5 for r in results), results


def test_torch_dist_join_rejects_mismatched_peer():
    """A ticket forged with the sender's layout still fails at the join handshake."""
    dc, sc = make_cache(None), make_cache(1, block_size=8)
    d = TorchDistTransport(dc, "d0", connect_timeout_s=LONG)
    p = TorchDistTransport(sc, "p1", serve=False, connect_timeout_s=LONG)
    try:
        forged = new_ticket(d.endpoint, sc.layout, "req", [0], 8, LONG)
        p.open(forged, [0])
        (res,) = drive([d, p], 1)
        assert not res.ok
        assert "block_size: 4 (decode d0) != 8 (prefill p1)" in (res.error or ""), res.error
    finally:
        d.close()
        p.close()


def test_torch_dist_sender_rejoins_a_pair_the_receiver_dropped():
    """White-box: the receiver forgets the pair (as after a failure the sender never saw); the
    sender's next transfer notices, joins with generation 2 and goes through."""
    sc, dc = make_cache(7), make_cache(None)
    d = TorchDistTransport(dc, "d0", connect_timeout_s=LONG)
    p = TorchDistTransport(sc, "p0", serve=False, connect_timeout_s=LONG)
    try:
        warm_up(p, d)
        receiver = d._receiver
        assert receiver is not None
        receiver.drop_pair(receiver._pairs["p0"])
        transfer(p, d, [3, 4], [5, 6], 2 * BLOCK)
        assert all(r.ok for r in drive([d, p], 2))
        assert_same_kv(sc, [3, 4], dc, [5, 6])
        assert receiver._pairs["p0"].gen == 2
    finally:
        d.close()
        p.close()


def make_int8_cache(seed: int | None, model_dtype: torch.dtype = torch.bfloat16) -> KVCache:
    """An int8 cache (values + float16 scales per block); `seed`: random bytes in every block
    (any bytes: the transport moves blocks without reading them)."""
    cache = KVCache(model_config(), BLOCKS, BLOCK, model_dtype, model_name="m", cache_dtype="int8")
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        cache.kv.copy_(torch.randint(-128, 128, cache.kv.shape, generator=gen))
    return cache


@pytest.mark.parametrize("plane", ["loopback", "gloo_bytes", "shared_memory"])
@pytest.mark.parametrize(
    ("src", "dst"),
    [
        ([40, 2, 17, 5, 33], [0, 1, 2, 3, 4, 30]),  # consecutive destination: in place
        ([40, 2, 17, 5, 33], [30, 1, 20, 3, 9]),  # scattered: through staging
        ([10, 11, 12, 13, 14], [6, 7, 8, 9, 10]),  # consecutive source: a view of the cache
    ],
    ids=["in_place", "staged", "zero_copy_source"],
)
def test_int8_blocks_arrive_with_their_scales_byte_for_byte(
    plane: str, src: list[int], dst: list[int]
) -> None:
    """An int8 cache's blocks (values and scales) move as stored on every data plane: the
    receiver's blocks are the sender's bytes (no re-quantization), and the bytes moved are the
    int8 blocks' (about half a bfloat16 cache's)."""
    sc, dc = make_int8_cache(11), make_int8_cache(None)
    hub = LoopbackHub()
    d: KVTransport
    p: KVTransport
    if plane == "loopback":
        d, p = LoopbackTransport(hub, "d0", dc), LoopbackTransport(hub, "p0", sc)
    else:
        shm = plane == "shared_memory"
        d = TorchDistTransport(dc, "d0", connect_timeout_s=LONG, shared_memory=shm)
        p = TorchDistTransport(sc, "p0", serve=False, connect_timeout_s=LONG, shared_memory=shm)
    try:
        n_tokens = 4 * BLOCK + 1
        transfer(p, d, src, dst, n_tokens)
        results = drive([d, p], 2)
        assert all(r.ok for r in results), results
        if plane == "shared_memory":
            assert isinstance(p, TorchDistTransport) and p.shared_memory_peers() == ["d0"]
        assert_same_kv(sc, src, dc, dst)
        for layer in range(LAYERS):  # the scales, read through the views, are the sender's
            s_scales, d_scales = sc.layer(layer).scales, dc.layer(layer).scales
            assert s_scales is not None and d_scales is not None
            for s_blk, d_blk in zip(src, dst, strict=False):
                for side in (0, 1):  # as bits: random bytes include NaN patterns
                    want = s_scales[side][s_blk].view(torch.int16)
                    assert torch.equal(want, d_scales[side][d_blk].view(torch.int16))
        untouched = [b for b in range(BLOCKS) if b not in dst[:5]]
        assert torch.count_nonzero(dc.kv[:, untouched]) == 0
        # every plane reports the KV bytes it moved (the memfd plane: copied out of the
        # sender's cache), an int8 block's values and scales
        assert [r.nbytes for r in results] == [LAYERS * 5 * sc.kv[0, 0].numel()] * 2
    finally:
        d.close()
        p.close()


def test_cache_dtype_mismatch_names_both_values(factory: Factory):
    """int8 prefill against a full-precision decode worker (same model dtype): a hard error
    before any KV moves, naming both cache dtypes."""
    d = factory("d0", make_cache(None), True)
    p = factory("p0", make_int8_cache(1, model_dtype=torch.float32), False)
    ticket = new_ticket(d.endpoint, d.layout, "req", [0, 1], 8, LONG)
    with pytest.raises(LayoutMismatchError) as info:
        p.open(ticket, [0])
    msg = str(info.value)
    assert "cache_dtype: 'int8' (prefill p0) != 'float32' (decode d0)" in msg, msg
    assert "dtype: 'float32'" not in msg.replace("cache_dtype", ""), msg  # model dtypes agree


def test_torch_dist_join_rejects_a_cache_dtype_mismatch():
    """A ticket forged with the sender's int8 layout still fails at the join handshake."""
    dc, sc = make_cache(None), make_int8_cache(1, model_dtype=torch.float32)
    d = TorchDistTransport(dc, "d0", connect_timeout_s=LONG)
    p = TorchDistTransport(sc, "p1", serve=False, connect_timeout_s=LONG)
    try:
        forged = new_ticket(d.endpoint, sc.layout, "req", [0], 4, LONG)
        p.open(forged, [0])
        (res,) = drive([d, p], 1)
        assert not res.ok
        assert "cache_dtype: 'float32' (decode d0) != 'int8' (prefill p1)" in (res.error or "")
    finally:
        d.close()
        p.close()
