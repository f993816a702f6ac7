"""The scheduler's "sending KV" state (prefill side), driven with fabricated tokens.

Scripted lifecycles with numbered steps: a request whose blocks a transfer reads keeps them
after it finishes, until the transport's one result frees them, whatever order the result, an
abandonment and an abort come in; a given-up send's blocks wait for their transfer's result
under its transfer id while the request id is free again; every test ends with every block
free again.
"""

from __future__ import annotations

import pytest

from model_runtime.scheduler import Scheduler
from tests.unit.test_scheduler import assert_all_free, make, req


def run_and_open(s: Scheduler, rid: str, tid: str, prompt: int = 6) -> list[int]:
    """Queue `rid` (max_tokens 1) and run its step, opening its send as the hand-off owner does
    in the prefill role's `before_forward`; return the blocks the send now holds."""
    free = s.block_pool.num_free
    s.add(req(rid, prompt, max_tokens=1))
    out = s.schedule()
    (item,) = out.items
    assert item.samples
    s.open_send(rid, tid)  # 1. the transport reads the blocks from now on
    assert rid in s.sending and s.sends(s.requests[rid])
    s.check_integrity()  # still running: counted once, with `running`
    (final,) = s.update(out, [50])  # 2. the first token ends the request
    assert final.finished and not s.has_unfinished()
    s.check_integrity()  # finished: counted once, with the send
    blocks = list(s.sending[rid].request.block_ids)
    # (a retry of an abandoned send may share its prefix-cached blocks: both only read them)
    assert blocks and s.block_pool.num_free >= free - len(blocks)
    return blocks


def test_a_send_holds_the_blocks_until_its_result() -> None:
    s = make()
    run_and_open(s, "a", "t1")
    assert s.num_parked() == 1
    s.send_result("a")  # 3. the result frees them
    assert "a" not in s.sending
    assert_all_free(s)


def test_an_abandoned_send_is_freed_at_its_result() -> None:
    s = make()
    blocks = run_and_open(s, "a", "t1")
    s.abandon_send("a")  # 3. cancelled while the transport still reads
    assert "a" not in s.sending and s.abandoned["t1"].block_ids == blocks
    assert s.num_parked() == 1
    assert s.block_pool.num_free == s.block_pool.num_blocks - len(blocks)  # not yet free
    s.check_integrity()
    s.release_abandoned("t1")  # 4. the result frees them
    assert_all_free(s)


def test_aborting_a_running_request_with_an_open_send_waits_for_the_result() -> None:
    s = make()
    s.add(req("a", 6, max_tokens=1))
    out = s.schedule()
    s.open_send("a", "t1")  # 1. open, the step has not ended
    s.abort("a")  # 2. e.g. an engine-thread failure aborts everything
    assert "t1" in s.abandoned and not s.has_unfinished() and not s.sending
    s.check_integrity()  # the abandoned transfer holds the blocks: the transport reads them
    assert s.update(out, [50]) == []  # 3. the step's results skip the aborted request
    s.release_abandoned("t1")  # 4. freed at the result
    assert_all_free(s)


def test_without_an_open_send_the_blocks_are_freed_when_it_finishes() -> None:
    s = make()
    s.add(req("a", 6, max_tokens=1))
    out = s.schedule()  # 1. its open failed: no `open_send`
    s.update(out, [50])
    assert not s.sending
    assert_all_free(s)


def test_freed_exactly_once() -> None:
    s = make()
    run_and_open(s, "a", "t1")
    s.send_result("a")
    with pytest.raises(KeyError):  # 1. a second result: the send is gone
        s.send_result("a")
    with pytest.raises(KeyError):  # 2. abandoning it after it was freed
        s.abandon_send("a")
    run_and_open(s, "b", "t2")
    s.abandon_send("b")
    with pytest.raises(KeyError):  # 3. abandoned twice: the live send is gone
        s.abandon_send("b")
    s.release_abandoned("t2")
    with pytest.raises(KeyError):  # 4. a second result of the abandoned transfer
        s.release_abandoned("t2")
    assert_all_free(s)


def test_ids_stay_taken_while_a_live_send_holds_the_blocks() -> None:
    s = make()
    run_and_open(s, "a", "t1")
    with pytest.raises(ValueError, match="already in use"):  # 1. finished, blocks still held
        s.add(req("a", 6))
    s.add(req("b", 6, max_tokens=1))
    s.schedule()
    s.open_send("b", "t2")
    with pytest.raises(ValueError, match="already sends"):  # 2. one send per request
        s.open_send("b", "t3")
    with pytest.raises(ValueError, match="not running"):  # 3. a finished request sends nothing
        s.open_send("a", "t9")
    s.abort("b")
    s.send_result("a")
    s.release_abandoned("t2")
    assert_all_free(s)


def test_an_abandoned_send_frees_the_request_id_at_once() -> None:
    """A router retrying a cancelled request on this worker reuses its id while the earlier
    transfer's blocks still wait for their result."""
    s = make()
    run_and_open(s, "a", "t1")
    s.abandon_send("a")  # 1. cancelled; its transfer still reads the blocks
    run_and_open(s, "a", "t2")  # 2. the retry: same request id, a new transfer
    s.release_abandoned("t1")  # 3. the first transfer's result frees only its own blocks
    assert s.sending["a"].transfer_id == "t2"
    s.check_integrity()
    s.send_result("a")
    assert_all_free(s)


def test_a_result_before_the_request_finished_is_a_broken_invariant() -> None:
    s = make()
    s.add(req("a", 6, max_tokens=1))
    out = s.schedule()
    s.open_send("a", "t1")
    with pytest.raises(AssertionError, match="result before request 'a' finished"):
        s.send_result("a")
    s.update(out, [50])  # the invariant kept nothing half-done: the send still holds them
    s.send_result("a")
    assert_all_free(s)


def test_check_integrity_sees_a_send_the_pool_lost() -> None:
    s = make()
    blocks = run_and_open(s, "a", "t1")
    s.block_pool.free([blocks[-1]])  # a free behind the scheduler's back
    with pytest.raises(AssertionError, match="pool ref count 0, held by 1"):
        s.check_integrity()
