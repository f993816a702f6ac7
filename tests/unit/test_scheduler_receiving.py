"""The scheduler's "receiving KV" reservations (decode side), driven with fabricated tokens.

Scripted lifecycles with numbered steps: a reservation's blocks are freed exactly once, or
handed to its request once, whatever order the transport's result, an abandonment and the
admission come in; reservations key by request id, a given-up one's blocks wait for their
transfer's result under its transfer id; every test ends with every block free again.
"""

from __future__ import annotations

import pytest

from model_runtime.request import Request, RequestStatus
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import Receive, Scheduler
from tests.unit.test_scheduler import EOS, assert_all_free, drain, make


def prefilled(rid: str, prompt: int = 6, max_tokens: int = 4) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    r = Request(rid, list(range(10, 10 + prompt)), params, eos_token_ids=(EOS,))
    r.status = RequestStatus.RUNNING
    return r


def reserve(s: Scheduler, rid: str = "a", tid: str = "t1", blocks: int = 3) -> list[int]:
    got = s.reserve_remote(rid, tid, blocks)
    assert got is not None and len(got) == blocks
    s.check_integrity()  # the reservation's blocks are counted as the scheduler's
    return got


def test_received_kv_is_admitted_and_decodes_to_the_end() -> None:
    s = make()
    reserve(s)  # 1. blocks for the incoming KV
    assert s.remote_state("a") is Receive.RECEIVING
    assert s.remote_result("a", ok=True)  # 2. the transport wrote every layer
    assert s.remote_state("a") is Receive.RECEIVED
    assert s.admit_remote(prefilled("a"), first_token=50) is None  # 3. handed over
    assert s.remote_state("a") is None
    finals = drain(s)  # 4. decodes: the request frees the blocks
    assert len(finals["a"].output_token_ids) == 4
    assert_all_free(s)


def test_a_failed_transfer_frees_its_blocks() -> None:
    s = make()
    reserve(s)
    assert not s.remote_result("a", ok=False)
    assert s.remote_state("a") is None
    assert_all_free(s)


def test_abandoned_in_flight_is_freed_at_the_result() -> None:
    s = make()
    blocks = reserve(s)
    assert s.abandon_remote("a")  # 1. cancelled while the transport still writes
    assert s.remote_state("a") is None and s.abandoned["t1"].block_ids == blocks
    assert s.block_pool.num_free == s.block_pool.num_blocks - 3  # 2. not yet free
    s.check_integrity()
    reserve(s, "a", "t2")  # 3. the id is free again: a retry reserves anew
    s.release_abandoned("t1")  # 4. the first transfer's result frees its blocks, ok or not
    assert not s.remote_result("a", ok=False)
    assert_all_free(s)


def test_abandoned_after_receipt_is_freed_at_once() -> None:
    s = make()
    reserve(s)
    assert s.remote_result("a", ok=True)
    assert not s.abandon_remote("a")
    assert_all_free(s)


def test_a_refused_admission_keeps_the_reservation() -> None:
    s = make()
    reserve(s)
    s.remote_result("a", ok=True)
    with pytest.raises(ValueError, match="cannot hold"):  # 1. 3 blocks of 4 < 20 tokens
        s.admit_remote(prefilled("a", prompt=20), first_token=50)
    assert s.remote_state("a") is Receive.RECEIVED  # 2. nothing taken over
    s.abandon_remote("a")
    assert_all_free(s)


def test_a_first_token_that_ends_the_request_frees_at_once() -> None:
    s = make()
    reserve(s)
    s.remote_result("a", ok=True)
    out = s.admit_remote(prefilled("a", max_tokens=1), first_token=50)
    assert out is not None and out.finished
    assert_all_free(s)


def test_freed_exactly_once() -> None:
    s = make()
    reserve(s)
    s.remote_result("a", ok=False)
    with pytest.raises(KeyError):  # 1. a second result: the reservation is gone
        s.remote_result("a", ok=False)
    with pytest.raises(KeyError):  # 2. abandoning it after it was freed
        s.abandon_remote("a")
    reserve(s, "b", "t2")
    s.abandon_remote("b")
    with pytest.raises(KeyError):  # 3. abandoned twice: the live reservation is gone
        s.abandon_remote("b")
    s.release_abandoned("t2")
    reserve(s, "c", "t3")
    s.remote_result("c", ok=True)
    with pytest.raises(AssertionError, match="a second result"):
        s.remote_result("c", ok=True)
    s.abandon_remote("c")
    assert_all_free(s)


def test_short_of_blocks_is_none_and_ids_are_unique() -> None:
    s = make(num_blocks=4)
    reserve(s, "a", "t1", 3)
    assert s.reserve_remote("b", "t2", 2) is None  # out of capacity: None, nothing taken
    with pytest.raises(ValueError, match="already in use"):
        s.reserve_remote("a", "t3", 1)
    s.remote_result("a", ok=False)
    assert_all_free(s)


def test_check_integrity_sees_a_reservation_the_pool_lost() -> None:
    s = make()
    blocks = reserve(s)
    s.block_pool.free([blocks[0]])  # a free behind the scheduler's back
    with pytest.raises(AssertionError, match="pool ref count 0, held by 1"):
        s.check_integrity()
