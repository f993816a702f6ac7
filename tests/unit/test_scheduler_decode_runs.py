"""`Scheduler.decode_steps` against the step-by-step path: from random decode-only states
(prefix hits, evictions, prefilled requests waiting for a slot, requests finishing, a
reservation between a step's two halves), `k` steps applied at once leave the scheduler, its
requests and its block pool — KV events included — exactly as `k` x (`schedule()`;
`update()`) do. Pure, about a second."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest

from model_runtime.block_pool import BlockPool, KVCacheEvent
from model_runtime.request import Request
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import Scheduler, SchedulerConfig

TOKEN = 3


class Events:
    """The pool's KV events, in order (an object, so that `deepcopy` copies it)."""

    def __init__(self) -> None:
        self.seen: list[KVCacheEvent] = []

    def __call__(self, event: KVCacheEvent) -> None:
        self.seen.append(event)


def _state(s: Scheduler, events: Events, rows: list[Request]) -> dict[str, Any]:
    pool = s.block_pool
    return {
        "running": [r.request_id for r in s.running],
        "waiting": [r.request_id for r in s.waiting],
        "ready": [r.request_id for r in s.ready],
        "requests": sorted(s.requests),
        "rows": [dataclasses.asdict(r) for r in rows],
        "remote": {t: (kv.block_ids, kv.state) for t, kv in s.remote.items()},
        "ref": list(pool._ref),
        "free": list(pool._free),
        "evictable": list(pool._evictable),
        "hash_of": list(pool._hash_of.items()),
        "block_of": list(pool._block_of.items()),
        "events": list(events.seen),
        "decode_scheduled": s.decode_scheduled,
    }


def _scheduler(rng: random.Random) -> tuple[Scheduler, Events, list[Request]]:
    """A scheduler driven step by step into a decode-only state, with history."""
    events = Events()
    pool = BlockPool(rng.choice([40, 64, 200]), listener=events)
    cfg = SchedulerConfig(
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=rng.choice([3, 4, 8]),
        max_model_len=1024,
    )
    s = Scheduler(cfg, pool)
    made: list[Request] = []
    shared = [5] * 8
    for i in range(rng.randint(3, 7)):
        prompt = (shared if rng.random() < 0.5 else [100 + i] * 4) + [i] * rng.randint(1, 9)
        params = SamplingParams(max_tokens=rng.randint(2, 40), ignore_eos=True)
        r = Request(f"r{i}", prompt, params, arrival_time=0.0)
        s.add(r)
        made.append(r)
    if rng.random() < 0.5:  # a prefilled request through a reservation
        prompt = [7] * rng.randint(3, 10)
        params = SamplingParams(max_tokens=rng.randint(2, 30), ignore_eos=True)
        blocks = -(-(len(prompt) + params.max_tokens - 1) // cfg.block_size)
        if s.reserve_remote("t", blocks) is not None:
            assert s.remote_result("t", ok=True)
            r = Request("p0", prompt, params, arrival_time=0.0)
            s.admit_remote("t", r, TOKEN)
            made.append(r)
    for _ in range(200):
        if s.decode_run_limit(TOKEN) >= 2 and rng.random() < 0.3:
            break
        out = s.schedule()
        s.update(out, [TOKEN if it.samples else None for it in out.items])
    return s, events, made


def _one_by_one(s: Scheduler, k: int, between: Any = None) -> None:
    for i in range(k):
        out = s.schedule()
        assert out.items and not out.preempted_ids
        assert all(len(it.token_ids) == 1 and it.samples for it in out.items)
        if between is not None and i == k - 1:
            between(s)
        s.update(out, [TOKEN] * len(out.items))


def _reserve(s: Scheduler) -> None:
    s.reserve_remote("late", 1)


@pytest.mark.parametrize("seed", range(40))
def test_decode_steps_equal_the_step_by_step_path(seed: int) -> None:
    rng = random.Random(seed)
    s, events, _ = _scheduler(rng)
    limit = s.decode_run_limit(TOKEN)
    if limit == 0:
        pytest.skip("no decode-only state reached")
    k = rng.randint(1, limit)
    a, ea = copy.deepcopy((s, events))
    b, eb = copy.deepcopy((s, events))
    rows_a = [r for r in [*a.running, *a.ready]]
    rows_b = [r for r in [*b.running, *b.ready]]
    _one_by_one(a, k)
    b.decode_steps(k, TOKEN)
    assert _state(a, ea, rows_a) == _state(b, eb, rows_b)
    a.check_integrity()
    b.check_integrity()


@pytest.mark.parametrize("seed", range(40))
def test_two_halves_with_a_reservation_between_equal_the_step_by_step_path(seed: int) -> None:
    """Steps 1..j-1 and the first half of step j, a reservation, then the rest: what
    `sim_engine` does when something changes the pool in the middle of a step."""
    rng = random.Random(1000 + seed)
    s, events, _ = _scheduler(rng)
    limit = s.decode_run_limit(TOKEN)
    if limit < 2:
        pytest.skip("no decode run of two steps reached")
    j = rng.randint(1, limit - 1)
    k = rng.randint(j, limit)
    a, ea = copy.deepcopy((s, events))
    b, eb = copy.deepcopy((s, events))
    rows_a = [r for r in [*a.running, *a.ready]]
    rows_b = [r for r in [*b.running, *b.ready]]
    _one_by_one(a, j, between=_reserve)
    _one_by_one(a, k - j)
    b.decode_steps(j - 1, TOKEN, then_schedule=True)
    assert b.decode_scheduled
    _reserve(b)
    rest = k - j + 1
    assert b.decode_run_limit(TOKEN, scheduled=True) >= 1
    b.decode_steps(1, TOKEN, scheduled=True)
    if rest > 1:
        b.decode_steps(rest - 1, TOKEN)
    assert _state(a, ea, rows_a) == _state(b, eb, rows_b)
    b.check_integrity()


@pytest.mark.parametrize("seed", range(40))
def test_the_limit_is_the_last_decode_only_step_before_a_finish_or_a_preemption(
    seed: int,
) -> None:
    rng = random.Random(2000 + seed)
    s, _, _ = _scheduler(rng)
    limit = s.decode_run_limit(TOKEN)
    if limit == 0:
        pytest.skip("no decode-only state reached")
    a = copy.deepcopy(s)
    for i in range(1, limit + 2):
        out = a.schedule()
        pure = (
            bool(out.items)
            and all(len(it.token_ids) == 1 and it.samples and it.start_pos >= 1 for it in out.items)
            and not out.preempted_ids
            and len(out.items) == len(a.running)
        )
        done = [
            o
            for o in a.update(out, [TOKEN if it.samples else None for it in out.items])
            if o.finished
        ]
        if i <= limit:
            assert pure, (i, limit, out)
            assert not done or i == limit, (i, limit)
        if done and i == limit:
            return  # a row finished in the last step
    # nothing finished at the limit: the step after it was not a clean decode step
    assert not pure, (limit, out)
