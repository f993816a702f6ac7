"""Who takes a free running slot on a decode worker that also prefills locally (hybrid): a
waiting prompt or a prefilled request (`ready`). First come, first served, in the order the
scheduler took them; a slot never idles behind a waiting head that cannot run. Scripted
steps on fabricated tokens; every test ends with every block free."""

from __future__ import annotations

from model_runtime.scheduler import Scheduler
from tests.unit.test_scheduler import assert_all_free, drain, make, req, step
from tests.unit.test_scheduler_receiving import prefilled


def hand_over(s: Scheduler, rid: str, tid: str, max_tokens: int = 4) -> None:
    """A prefilled request's KV arrives: reserve, receive, admit (it waits in `ready`)."""
    assert s.reserve_remote(rid, tid, 3) is not None and s.remote_result(rid, ok=True)
    request = prefilled(rid, max_tokens=max_tokens)
    assert s.admit_remote(request, first_token=50) is None


def running_ids(s: Scheduler) -> list[str]:
    return [r.request_id for r in s.running]


def test_a_waiting_prompt_is_not_starved_by_later_prefilled_arrivals() -> None:
    s = make(num_blocks=32, max_seqs=1)
    hand_over(s, "first", "t0")
    step(s)  # "first" takes the only slot
    s.add(req("local", 6))  # a local prompt queues behind it ...
    for k in range(3):  # ... then prefilled requests keep arriving
        hand_over(s, f"remote{k}", f"t{k + 1}")
    while "first" in s.requests:
        step(s)
    step(s)
    assert running_ids(s) == ["local"]  # the slot goes to the prompt that came first
    finals = drain(s)
    assert set(finals) == {"local", "remote0", "remote1", "remote2"}
    assert_all_free(s)


def test_a_later_waiting_prompt_leaves_the_slot_to_an_earlier_prefilled_request() -> None:
    s = make(num_blocks=32, max_seqs=2)
    s.add(req("a", 6))
    hand_over(s, "remote", "t1", max_tokens=12)
    s.add(req("b", 6))
    step(s)  # "a" admitted; "b" came after "remote", so it stops admission
    assert running_ids(s) == ["a"] and [r.request_id for r in s.waiting] == ["b"]
    step(s)  # the free slot is "remote"'s, before "b"'s
    assert running_ids(s) == ["a", "remote"] and [r.request_id for r in s.waiting] == ["b"]
    while "a" in s.requests:
        step(s)
    step(s)
    assert running_ids(s) == ["remote", "b"]
    drain(s)
    assert_all_free(s)


def test_a_prefilled_request_that_came_first_goes_first_and_decodes_at_once() -> None:
    s = make(num_blocks=32, max_seqs=1)
    hand_over(s, "remote", "t1")
    s.add(req("local", 6))
    out, _ = step(s)
    assert [i.request_id for i in out.items] == ["remote"]  # promoted at step 0: decodes now
    assert running_ids(s) == ["remote"] and [r.request_id for r in s.waiting] == ["local"]
    drain(s)
    assert_all_free(s)


def test_a_slot_does_not_wait_on_a_head_that_cannot_run() -> None:
    # 6 blocks: the prefilled request holds 3 (it arrived after the prompt), the prompt needs
    # 5 of the 3 left; the slot goes to the prefilled one rather than to nobody
    s = make(num_blocks=6, block_size=4, max_seqs=2)
    s.add(req("big", 17, max_tokens=4))
    hand_over(s, "remote", "t1")
    out, _ = step(s)
    assert [i.request_id for i in out.items] == ["remote"] and running_ids(s) == ["remote"]
    finals = drain(s)
    assert set(finals) == {"big", "remote"}
    assert_all_free(s)
