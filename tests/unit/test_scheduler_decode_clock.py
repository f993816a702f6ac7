"""`DecodeClock` against the step-by-step path: from random states (prefix hits, evictions,
prefilled requests arriving through reservations, reservations between a step's two halves,
requests finishing and aborted, preemptions that stop the clock), the same steps driven by
the clock — restarted whenever the next step is decode-only again — give the same outputs at
every step and leave the scheduler, its requests and its block pool, KV events included,
exactly as `schedule()` / `update()` do. With the rows whose blocks no other request shares
deferring their registrations, the same except the order the hashes were registered in.
Pure, a few seconds."""

from __future__ import annotations

import copy
import dataclasses
import random
from typing import Any

import pytest

from model_runtime.block_pool import BlockPool, KVCacheEvent
from model_runtime.decode_clock import DecodeClock
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


def _state(s: Scheduler, events: Events, made: list[Request], exact: bool) -> dict[str, Any]:
    pool = s.block_pool
    state = {
        "running": [r.request_id for r in s.running],
        "waiting": [r.request_id for r in s.waiting],
        "ready": [r.request_id for r in s.ready],
        "requests": sorted(s.requests),
        "made": [dataclasses.asdict(r) for r in made],
        "remote": {t: (kv.block_ids, kv.state) for t, kv in s.remote.items()},
        "ref": list(pool._ref),
        "free": list(pool._free),
        "evictable": list(pool._evictable),
        "hash_of": sorted(pool._hash_of.items()),
        "block_of": sorted(pool._block_of.items()),
    }
    if exact:
        state["hash_order"] = list(pool._hash_of.items())
        state["events"] = list(events.seen)
    return state


def _scheduler(rng: random.Random) -> tuple[Scheduler, Events, list[Request]]:
    """A scheduler driven step by step for a while, with history."""
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
    for _ in range(rng.randint(0, 12)):
        out = s.schedule()
        s.update(out, [TOKEN if it.samples else None for it in out.items])
    return s, events, made


class Driver:
    """Steps one scheduler, by the clock (`clocked`) or by `schedule()` / `update()`."""

    def __init__(self, s: Scheduler, clocked: bool, defer: bool) -> None:
        self.s = s
        self.clocked = clocked
        self.defer = _unique if defer else None
        self.clock: DecodeClock | None = None
        self.clock_steps = 0
        self.out: Any = None

    def begin(self) -> bool:
        """The first half of the next step; False: nothing to run."""
        if self.clocked and self.clock is None:
            self.clock = DecodeClock.start(self.s, TOKEN, self.defer)
        if self.clock is not None:
            begun = self.clock.begin_step()
            if begun is not None:
                self.out = None
                return begun[0] > 0
            self.clock.stop()
            self.clock = None
        self.out = self.s.schedule()
        return bool(self.out.items)

    def end(self) -> list[tuple[str, tuple[int, ...], bool]]:
        """The second half; the outputs of the finished requests."""
        if self.out is None:
            assert self.clock is not None
            self.clock_steps += 1
            outs = self.clock.end_step()
        else:
            sampled = [TOKEN if it.samples else None for it in self.out.items]
            outs = [o for o in self.s.update(self.out, sampled) if o.finished]
        return [(o.request_id, o.new_token_ids, o.finished) for o in outs]

    def abort(self, request_id: str) -> None:
        if self.clock is not None:
            self.clock.forget(request_id)
        self.s.abort(request_id)

    def stop(self) -> None:
        if self.clock is not None:
            self.clock.stop()
            self.clock = None


def _unique(r: Request) -> bool:
    """The request's blocks are its own: its prompt starts with a token no other has."""
    return r.prompt_token_ids[0] >= 100


def _prefilled(s: Scheduler, rid: str, rng: random.Random, n: int) -> Request | None:
    prompt = ([1000 + n] if rng.random() < 0.5 else [7]) + [7] * rng.randint(2, 9)
    params = SamplingParams(max_tokens=rng.randint(2, 30), ignore_eos=True)
    blocks = -(-(len(prompt) + params.max_tokens - 1) // s.config.block_size)
    if s.reserve_remote(rid, f"t-{rid}", blocks) is None:
        return None
    assert s.remote_result(rid, ok=True)
    r = Request(rid, prompt, params, arrival_time=0.0)
    s.admit_remote(r, TOKEN)
    return r


def _drive(d: Driver, made: list[Request], seed: int, steps: int) -> list[Any]:
    """`steps` steps with the same random actions between and inside them."""
    rng = random.Random(seed)
    log: list[Any] = []
    for i in range(steps):
        ran = d.begin()
        roll = rng.random()
        if roll < 0.15:  # a reservation between the two halves
            d.s.reserve_remote(f"mid{i}", f"t-mid{i}", rng.randint(1, 3))
        elif roll < 0.2 and d.s.running:  # a row aborted between the two halves
            d.abort(sorted(r.request_id for r in d.s.running)[0])
        log.append(d.end() if ran else "idle")
        roll = rng.random()
        if roll < 0.25:  # a prefilled request arrives
            r = _prefilled(d.s, f"p{i}", rng, len(made))
            if r is not None:
                made.append(r)
        elif roll < 0.3 and f"mid{i - 1}" in d.s.remote:  # a reservation freed
            d.s.remote_result(f"mid{i - 1}", ok=False)
    d.stop()
    return log


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize("seed", range(30))
def test_the_clock_equals_the_step_by_step_path(seed: int, defer: bool) -> None:
    rng = random.Random(seed)
    s, events, made = _scheduler(rng)
    a, ea, made_a = copy.deepcopy((s, events, made))
    b, eb, made_b = copy.deepcopy((s, events, made))
    slow, fast = Driver(a, clocked=False, defer=False), Driver(b, clocked=True, defer=defer)
    log_a = _drive(slow, made_a, seed, 80)
    log_b = _drive(fast, made_b, seed, 80)
    assert log_a == log_b
    assert _state(a, ea, made_a, exact=not defer) == _state(b, eb, made_b, exact=not defer)
    assert fast.clock_steps > 10  # the clock drove steps
    a.check_integrity()
    b.check_integrity()
