"""Pure pieces of kvtransfer: tickets, verdicts, layout checks, control records, layer writes."""

from __future__ import annotations

import dataclasses
import json
import threading
import time

import numpy as np
import pytest
import torch

from kvtransfer import rendezvous as rdv
from kvtransfer.dist_send import Sender, SendTransfer
from kvtransfer.staging import StagingPool, copy_runs, read_layer, write_layer
from kvtransfer.types import (
    Code,
    LayoutMismatchError,
    PeerEndpoint,
    TransferError,
    TransferResult,
    TransferTicket,
    blocks_needed,
    check_layout,
    header_verdict,
    layout_from_dict,
    layout_to_dict,
    new_ticket,
)
from kvtransfer.wire import EventQueue, HelperThreads, control_tensor, empty_control, read_code
from model_runtime.kv_cache import KVCache, KVLayout
from tests.fakes.model_configs import tiny_model_config

LAYOUT = KVLayout("m", "float32", 16, 4, 2, 8, "float32")
EP = PeerEndpoint("d0", "127.0.0.1", 4242)


def test_blocks_needed_covers_partial_blocks():
    assert [blocks_needed(n, 16) for n in (1, 15, 16, 17, 32, 33)] == [1, 1, 1, 2, 2, 3]


def test_ticket_round_trips_through_json():
    t = new_ticket(EP, LAYOUT, "r1", [5, 9, 2], 40, 1.5, transfer_id="x", epoch=3)
    again = TransferTicket.from_dict(json.loads(json.dumps(t.to_dict())))
    assert again == t
    assert again.num_blocks == 3 and again.timeout_ms == 1500


def test_new_ticket_makes_unique_ids_under_the_receiver():
    a, b = (new_ticket(EP, LAYOUT, "r", [0], 1, 1.0) for _ in range(2))
    assert a.transfer_id != b.transfer_id and a.transfer_id.startswith("d0/")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_tokens": 0}, "num_tokens must be positive"),
        ({"dst_block_ids": (1,), "num_tokens": 17}, "needs 2"),
        ({"dst_block_ids": (1, 1)}, "duplicates"),
        ({"epoch": -1}, "epoch must be >= 0"),
        ({"timeout_ms": 0}, "timeout_ms must be positive"),
        ({"transfer_id": ""}, "transfer_id"),
    ],
)
def test_ticket_validation_names_the_field(kwargs: dict[str, object], match: str):
    fields: dict[str, object] = {
        "transfer_id": "t",
        "epoch": 0,
        "request_id": "r",
        "num_tokens": 3,
        "dst_block_ids": (1, 2),
        "receiver": EP,
        "layout": LAYOUT,
        "timeout_ms": 100,
    }
    fields.update(kwargs)
    with pytest.raises(ValueError, match=match):
        TransferTicket(**fields).validate()  # type: ignore[arg-type]


def test_layout_mismatch_names_every_field_and_both_values():
    other = KVLayout("other", "bfloat16", 32, 4, 2, 8, "int8")
    with pytest.raises(LayoutMismatchError) as info:
        check_layout(LAYOUT, other, "prefill p0", "decode d0")
    msg = str(info.value)
    assert "model_name: 'm' (prefill p0) != 'other' (decode d0)" in msg
    assert "dtype: 'float32' (prefill p0) != 'bfloat16' (decode d0)" in msg
    assert "block_size: 16 (prefill p0) != 32 (decode d0)" in msg
    assert "cache_dtype: 'float32' (prefill p0) != 'int8' (decode d0)" in msg
    check_layout(LAYOUT, LAYOUT, "a", "b")  # equal layouts pass


def test_layout_round_trips_with_its_cache_dtype():
    """A ticket's layout carries the cache dtype through JSON and protobuf; a peer from before
    int8 caches (no field) stores blocks in its model dtype."""
    from worker.convert import layout_from_proto, layout_to_proto

    int8 = dataclasses.replace(LAYOUT, dtype="bfloat16", cache_dtype="int8")
    assert layout_from_dict(layout_to_dict(int8)) == int8
    assert layout_from_proto(layout_to_proto(int8)) == int8
    old = {k: v for k, v in layout_to_dict(LAYOUT).items() if k != "cache_dtype"}
    assert layout_from_dict(old) == LAYOUT
    msg = layout_to_proto(LAYOUT)
    msg.cache_dtype = ""
    assert layout_from_proto(msg) == LAYOUT


def test_header_verdicts():
    t = new_ticket(EP, LAYOUT, "r", [0, 1], 20, 1.0, transfer_id="t", epoch=2)
    assert header_verdict(t, False, 2, 20) is Code.GO
    assert header_verdict(None, False, 2, 20) is Code.UNKNOWN_TRANSFER
    assert header_verdict(t, False, 1, 20) is Code.STALE_EPOCH
    assert header_verdict(t, False, 2, 21) is Code.SHAPE_MISMATCH
    assert header_verdict(t, True, 2, 20) is Code.ALREADY_OPEN
    assert all(c.describe() for c in Code)


def test_failed_result_raises_transfer_error_with_context():
    res = TransferResult("t", 1, "r", "recv", "p0", ok=False, error="deadline")
    with pytest.raises(TransferError, match=r"t \(epoch 1, request r, recv side, peer p0\).*"):
        res.raise_for_error()
    TransferResult("t", 1, "r", "send", "d0", ok=True).raise_for_error()


def test_control_records_are_json_and_checked():
    rec = rdv.decode(rdv.xfer_record("p0", 3, "t", 1, 7, 99, 1500).encode())
    assert rec == {
        "kind": "xfer",
        "sender": "p0",
        "gen": 3,
        "transfer_id": "t",
        "epoch": 1,
        "tag": 7,
        "num_tokens": 99,
        "timeout_ms": 1500,
    }
    assert rdv.join_layout(rdv.decode(rdv.join_record("p0", 1, LAYOUT))) == LAYOUT
    for bad in (b"[1, 2]", b'{"no_kind": 1}', b"not json"):
        with pytest.raises(ValueError):
            rdv.decode(bad)


def test_control_tensor_codes():
    assert read_code(control_tensor(Code.OK, torch.device("cpu"))) is Code.OK
    assert read_code(empty_control(torch.device("cpu"))) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_write_layer_matches_scatter_layer_bit_for_bit(dtype: torch.dtype):
    cfg = tiny_model_config()
    a, b = KVCache(cfg, 10, 4, dtype), KVCache(cfg, 10, 4, dtype)
    data = torch.randn((3, 2, 4, 2, 8), generator=torch.Generator().manual_seed(0)).to(dtype)
    for ids in ([7, 2, 5], [4, 5, 6]):  # scattered, and one run (a contiguous copy)
        a.scatter_layer(1, ids, data)
        write_layer(b, 1, ids, data)
        assert torch.equal(a.kv.view(torch.uint8), b.kv.view(torch.uint8)), ids
        data = data + 1
    with pytest.raises(ValueError, match="write_layer"):
        write_layer(b, 1, ids[:2], data)


def test_staging_copies_int8_blocks_with_their_scales():
    """read_layer / write_layer on an int8 cache: whole blocks (values, then scales) as
    `message_shape` says, the bytes of gather_layer / scatter_layer."""
    cfg = tiny_model_config()
    a, b = (KVCache(cfg, 10, 4, torch.bfloat16, cache_dtype="int8") for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    a.kv.copy_(torch.randint(-128, 128, a.kv.shape, generator=gen))
    for ids in ([7, 2, 5], [3, 4, 9]):
        out = torch.empty(a.message_shape(3), dtype=torch.int8)
        assert out.shape == (3, 2 * 4 * 2 * (8 + 2))
        read_layer(a, 1, ids, out)
        assert torch.equal(out, a.gather_layer(1, ids))
        write_layer(b, 1, ids, out)
        assert torch.equal(b.gather_layer(1, ids), out)
    with pytest.raises(ValueError, match="write_layer"):
        write_layer(b, 1, [1, 2], out)


def test_copy_runs_matches_indexed_copy_for_any_block_arrangement():
    gen = torch.Generator().manual_seed(2)
    src = torch.randint(0, 1 << 30, (40, 3, 5), generator=gen, dtype=torch.int32).numpy()
    cases = [  # (source ids, destination ids)
        ([4, 5, 6, 7], [10, 11, 12, 13]),  # one run on both sides
        ([30, 31, 32, 0, 1, 2], [5, 6, 7, 8, 9, 10]),  # a cached prefix, then fresh blocks
        ([3, 4, 5, 6], [20, 21, 9, 10]),  # runs break on the destination side only
        ([9, 8, 7, 6], [0, 1, 2, 3]),  # descending: single-block runs
        ([17], [33]),
        ([], []),
    ]
    perm = torch.randperm(40, generator=gen).tolist()
    cases.append((perm[:25], torch.randperm(40, generator=gen).tolist()[:25]))
    for src_ids, dst_ids in cases:
        want = np.zeros((40, 3, 5), dtype=np.int32)
        want[dst_ids] = src[src_ids]
        got = np.zeros_like(want)
        copy_runs(got, dst_ids, src, src_ids)
        assert np.array_equal(got, want), (src_ids, dst_ids)
    with pytest.raises(ValueError, match="2 destination ids for 3 source ids"):
        copy_runs(got, [0, 1], src, [0, 1, 2])


def test_helper_threads_join_is_bounded():
    release = threading.Event()
    helpers = HelperThreads()
    helpers.start("quick", lambda: None)
    helpers.start("stuck", release.wait)
    assert not helpers.join(timeout_s=0.05)
    release.set()
    assert helpers.join(timeout_s=2.0)


def test_helper_threads_are_reused_and_survive_a_failing_job():
    helpers = HelperThreads()
    seen: list[int] = []

    def record() -> None:
        seen.append(threading.get_ident())

    def fail() -> None:
        raise RuntimeError("a bug in a job")

    for job in (record, fail, record):
        helpers.start("job", job)
        assert helpers.join(timeout_s=2.0) is True  # also sends the idle thread home...
        helpers.start("next", record)  # ...so the next job gets a fresh one
        assert helpers.join(timeout_s=2.0)
    assert len(seen) == 5
    reuse = HelperThreads()
    first, second = threading.Event(), threading.Event()
    reuse.start("first", lambda: (record(), first.set()))
    assert first.wait(2.0)
    end = time.monotonic() + 2.0
    while reuse._idle == 0 and time.monotonic() < end:  # until the first job's thread is idle
        time.sleep(0.001)
    assert reuse._idle == 1
    reuse.start("second", lambda: (record(), second.set()))
    assert second.wait(2.0)
    assert seen[-1] == seen[-2]  # the idle thread took the second job
    assert reuse.join(timeout_s=2.0)


def test_config_picks_the_implementation_by_kind():
    from pydantic import TypeAdapter, ValidationError

    from kvtransfer.config import KVTransferConfig, LoopbackConfig, TorchDistConfig, make_transport
    from kvtransfer.loopback import LoopbackHub, LoopbackTransport

    adapter: TypeAdapter[object] = TypeAdapter(KVTransferConfig)
    cfg = adapter.validate_python({"kind": "torch_dist", "host": "10.0.0.5", "port": 0})
    assert isinstance(cfg, TorchDistConfig)
    assert cfg.host == "10.0.0.5" and cfg.connect_timeout_s == 10.0
    with pytest.raises(ValidationError, match="kind"):
        adapter.validate_python({"kind": "carrier_pigeon"})
    with pytest.raises(ValidationError, match="connect_timeout_s"):
        adapter.validate_python({"kind": "torch_dist", "connect_timeout_s": 0})
    cfg_model = tiny_model_config()
    cache = KVCache(cfg_model, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="LoopbackHub"):
        make_transport(LoopbackConfig(), cache, "w0")
    t = make_transport(LoopbackConfig(), cache, "w0", hub=LoopbackHub())
    assert isinstance(t, LoopbackTransport) and t.endpoint.worker_id == "w0"
    t.close()


def test_staging_pool_reuses_buffers_by_size_class_and_keeps_at_most_its_cap():
    pool = StagingPool(max_bytes=3 * 1024 * 4)
    a, b = pool.take_many(1000, torch.float32, torch.device("cpu"), 2)
    assert a.numel() == b.numel() == 1024  # the power-of-two class above 1000
    view = StagingPool.view(a, (10, 10, 10))
    assert view.shape == (10, 10, 10) and view.data_ptr() == a.data_ptr()
    pool.give([a, b])
    assert pool.kept_bytes == 2 * 1024 * 4
    again = pool.take(600, torch.float32, torch.device("cpu"))
    assert again.data_ptr() in (a.data_ptr(), b.data_ptr())  # reused, not fresh
    assert pool.take(600, torch.int64, torch.device("cpu")).dtype == torch.int64  # other class
    extra = pool.take_many(1024, torch.float32, torch.device("cpu"), 3)
    pool.give([again, *extra])
    assert pool.kept_bytes == 3 * 1024 * 4  # the cap: the fourth buffer was dropped


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_read_layer_matches_gather_layer_bit_for_bit(dtype: torch.dtype):
    cache = KVCache(tiny_model_config(), 10, 4, dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(1)))
    for ids in ([7, 2, 5], [3, 4, 9]):  # scattered; a run then a block
        out = torch.empty(cache.message_shape(3), dtype=dtype)
        assert read_layer(cache, 1, ids, out) is out
        assert torch.equal(out.view(torch.uint8), cache.gather_layer(1, ids).view(torch.uint8))
    with pytest.raises(ValueError, match="read_layer"):
        read_layer(cache, 1, ids[:2], out)


def test_a_transfer_past_its_deadline_never_joins_a_pair():
    """A sending thread that wakes up past its deadline (say, after its header push hung on a
    frozen receiver) must fail without a join: a doomed join would break the pair that live
    transfers share."""
    cache = KVCache(tiny_model_config(), 10, 4, torch.float32)
    sender = Sender("p", cache, "127.0.0.1", 1.0, EventQueue(), StagingPool())
    receiver = PeerEndpoint("d", "127.0.0.1", 9)  # nothing listens: a join would fail
    ticket = new_ticket(receiver, cache.layout, "req", [0], 3, 1.0)
    now = time.monotonic()
    tr = SendTransfer(ticket, (0,), started=now - 2.0, deadline=now - 1.0)
    # The transfer's own deadline: a TransferError of its own, never a pair failure.
    with pytest.raises(TransferError, match="deadline"):
        sender._send(tr)
    assert sender._pairs == {}  # no pair was created, so none could be broken
