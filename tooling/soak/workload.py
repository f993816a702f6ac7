"""The soak's seeded plan: every request (what, when, how it ends early) and every fault (what,
when, on which worker). Pure: no I/O, no clock; the same config gives the same plan.

Runs in the soak process (`pdserve soak`). Request kinds, as fractions of the Poisson stream:

- `greedy` token-id prompts (1..700 tokens; a third of them behind one of four shared prefixes,
  so prefix caching and prefix routing see hits), `text` prompts (corpus sentences), `sampled`
  (temperature / top-p / top-k with a seed);
- on top of the kind: a stop string (picked later from the request's own reference output, so
  it triggers: `with_stop_strings`), stop token ids, a client cancel after k tokens or after a
  delay (0..300 ms: while `Reserve` may still be in flight), a short deadline (0.15..2 s);
- `burst`: `config.num_bursts` groups of `config.burst_size` requests sent at one instant,
  more than the router admits, so the excess must get RESOURCE_EXHAUSTED; placed away from
  worker kills and freezes (`burst_times`). They ask for `BURST_MAX_TOKENS` and the client
  cancels the admitted ones once the burst is decided (`client.BurstGate`);
- `probe`: one per `kv-stall` fault: a long prompt with a short deadline, sent at the fault's
  time; the injector stalls its KV transfer (see `faults`);
- hostile clients, which must hurt nobody but themselves (`blast` checks that every other
  request still completes or is explained): `storm` — `config.num_storms` groups of
  `STORM_SIZE` requests sent at one instant with deadlines of 5, 15, ..., 95 ms (a long prompt,
  `max_tokens` 32); `oversized` — `config.num_oversized` HTTP chat requests whose one message is
  `config.oversized_mb` MB (the router must answer 400 naming ``messages[0].content`` within
  `OVERSIZED_MAX_S`); `disconnect` — `config.num_disconnects` HTTP streaming completions whose
  client resets the connection once the first event arrived.

Sampling values travel as float32 on the wire, so they are rounded to float32 here: the
reference must use exactly what the workers get.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass, replace
from typing import Literal

from tooling.soak.config import FaultKind, SoakConfig

RequestKind = Literal[
    "greedy", "text", "sampled", "burst", "probe", "storm", "oversized", "disconnect"
]
HTTP_KINDS = frozenset({"oversized", "disconnect"})  # sent to the HTTP front, not over gRPC
STORM_SIZE = 10
STORM_PROMPT = 120
OVERSIZED_MAX_S = 2.0
VOCAB_FLOOR = 4  # ids 0..3 are the random model's special tokens
PROBE_PROMPT = 800
PROBE_TIMEOUT_S = 1.5
BURST_MAX_TOKENS = 256
"""A burst request's length: far more than it may generate while its burst reaches the router,
so it holds its slot until the client's `BurstGate` ends it (`client`)."""
_PREFIX_LENGTHS = (48, 96, 160, 256)
# How long a killed worker takes to be restarted and rejoin, or a thawed one to be polled
# healthy again (tiny model, process launcher): bursts keep this far from such faults.
_RECOVERY_ALLOWANCE_S = 6.0
_BURST_SPACING_S = 5.0


def f32(x: float) -> float:
    """`x` rounded to float32, as protobuf's `float` fields carry it."""
    return float(struct.unpack("f", struct.pack("f", x))[0])


@dataclass(frozen=True)
class PlannedRequest:
    """One request of the soak. `at_s`: send time after the load starts. `timeout_s` None: no
    client deadline (the router's default applies). `cancel_after_tokens` / `cancel_after_s`:
    the client cancels once it has that many tokens / that long after sending."""

    index: int
    at_s: float
    kind: RequestKind
    token_ids: tuple[int, ...] | None = None
    text: str | None = None
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    stop: tuple[str, ...] = ()
    stop_at: float | None = None  # where in the reference text to cut a stop string (0..1)
    cancel_after_tokens: int | None = None
    cancel_after_s: float | None = None
    timeout_s: float | None = None
    burst: int | None = None

    @property
    def request_id(self) -> str:
        return f"soak-{self.index:05d}-{self.kind}"

    @property
    def sampling_key(self) -> tuple[object, ...]:
        """What decides the engine's output (stop strings do not: the router applies them)."""
        return (
            self.max_tokens,
            self.temperature,
            self.top_p,
            self.top_k,
            self.seed,
            self.stop_token_ids,
            self.ignore_eos,
        )


@dataclass(frozen=True)
class PlannedFault:
    """One fault: `target` indexes the workers of the kind's role (`stop`: all workers, prefill
    first); `kv-stall` picks its target at run time and carries its probe's request index."""

    index: int
    at_s: float
    kind: FaultKind
    target: int = 0
    duration_s: float = 0.0
    probe: int | None = None


@dataclass(frozen=True)
class SoakPlan:
    requests: tuple[PlannedRequest, ...]
    faults: tuple[PlannedFault, ...]
    duration_s: float  # when the last Poisson arrival is due


def _prompt_ids(rng: random.Random, prefixes: list[tuple[int, ...]], vocab: int) -> tuple[int, ...]:
    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB_FLOOR, vocab) for _ in range(n))

    if rng.random() < 0.35:
        return rng.choice(prefixes) + ids(rng.randint(1, 120))
    band = rng.random()
    if band < 0.4:
        return ids(rng.randint(1, 64))
    if band < 0.85:
        return ids(rng.randint(65, 300))
    return ids(rng.randint(301, 700))


def _sentences() -> list[str]:
    from tooling.models.corpus import PROSE

    return [s.strip() + "." for s in PROSE.replace("\n", " ").split(". ") if len(s) > 20]


def _stream_request(
    rng: random.Random, i: int, at: float, prefixes: list[tuple[int, ...]], vocab: int
) -> PlannedRequest:
    roll = rng.random()
    kind: RequestKind = "sampled" if roll < 0.22 else "text" if roll < 0.32 else "greedy"
    req = PlannedRequest(i, at, kind, max_tokens=rng.choice((1, 4, 8, 16, 16, 24, 32, 48)))
    if kind == "text":
        sents = _sentences()
        req = replace(req, text=" ".join(rng.choice(sents) for _ in range(rng.randint(1, 4))))
    else:
        req = replace(req, token_ids=_prompt_ids(rng, prefixes, vocab))
    if kind == "sampled":
        req = replace(
            req,
            temperature=f32(rng.uniform(0.5, 1.3)),
            top_p=f32(rng.choice((1.0, 0.95, 0.8))),
            top_k=rng.choice((0, 0, 20, 100)),
            seed=rng.randrange(2**62),
        )
    req = replace(req, ignore_eos=rng.random() < 0.5)
    extra = rng.random()
    if extra < 0.15:
        req = replace(req, stop_at=rng.uniform(0.2, 0.9))
    elif extra < 0.20:
        req = replace(req, stop_token_ids=(rng.randrange(VOCAB_FLOOR, vocab),))
    fate = rng.random()
    if fate < 0.05:
        req = replace(req, cancel_after_tokens=rng.randint(1, max(1, req.max_tokens - 1)))
    elif fate < 0.09:
        req = replace(req, cancel_after_s=rng.uniform(0.0, 0.3))
    elif fate < 0.17:
        req = replace(req, timeout_s=rng.uniform(0.15, 2.0))
    return req


def make_plan(config: SoakConfig, vocab: int) -> SoakPlan:
    """The seeded plan of `config` for a model of `vocab` tokens (see the module docstring)."""
    rng = random.Random(config.seed)
    counts = config.fault_counts()
    n_probe = counts.get("kv-stall", 0)
    n_burst = config.num_bursts * config.burst_size
    n_hostile = config.num_storms * STORM_SIZE + config.num_oversized + config.num_disconnects
    n_stream = config.requests - n_burst - n_probe - n_hostile
    if n_stream < 1:
        raise ValueError(
            f"requests={config.requests} leaves no room for the stream after {n_burst} burst, "
            f"{n_probe} probe and {n_hostile} hostile requests; raise requests or lower "
            "bursts / faults / storms / oversized / disconnects"
        )
    prefixes = [tuple(rng.randrange(VOCAB_FLOOR, vocab) for _ in range(n)) for n in _PREFIX_LENGTHS]
    times, t = [], 0.0
    for _ in range(n_stream):
        t += rng.expovariate(config.rate)
        times.append(t)
    duration = t
    out = [_stream_request(rng, 0, at, prefixes, vocab) for at in times]
    faults = _fault_schedule(rng, config, duration)
    for b, at in enumerate(burst_times(faults, config.num_bursts, duration)):
        for _ in range(config.burst_size):
            ids = tuple(rng.randrange(VOCAB_FLOOR, vocab) for _ in range(rng.randint(16, 64)))
            out.append(PlannedRequest(0, at, "burst", ids, max_tokens=BURST_MAX_TOKENS,
                                      ignore_eos=True, burst=b))  # fmt: skip
    for f in faults:
        if f.kind == "kv-stall":
            ids = tuple(rng.randrange(VOCAB_FLOOR, vocab) for _ in range(PROBE_PROMPT))
            probe = PlannedRequest(0, f.at_s, "probe", ids, max_tokens=8, timeout_s=PROBE_TIMEOUT_S)
            out.append(probe)
    out += _hostile(rng, config, duration, vocab)
    out.sort(key=lambda r: r.at_s)
    requests = tuple(replace(r, index=i) for i, r in enumerate(out))
    probe_at = {r.at_s: r.index for r in requests if r.kind == "probe"}
    faults = [replace(f, probe=probe_at[f.at_s]) if f.kind == "kv-stall" else f for f in faults]
    return SoakPlan(requests, tuple(faults), duration)


def _hostile(
    rng: random.Random, config: SoakConfig, duration: float, vocab: int
) -> list[PlannedRequest]:
    """Deadline storms, oversized chat bodies and abrupt disconnects (module docstring), at
    seeded times over 10..90 % of the load."""
    out = []

    def at() -> float:
        return rng.uniform(0.1, 0.9) * duration

    def ids(n: int) -> tuple[int, ...]:
        return tuple(rng.randrange(VOCAB_FLOOR, vocab) for _ in range(n))

    for _ in range(config.num_storms):
        t, prompt = at(), ids(STORM_PROMPT)
        for k in range(STORM_SIZE):
            deadline = (5 + 10 * k) / 1000
            out.append(PlannedRequest(0, t, "storm", prompt, max_tokens=32, ignore_eos=True,
                                      timeout_s=deadline))  # fmt: skip
    for _ in range(config.num_oversized):
        out.append(PlannedRequest(0, at(), "oversized"))
    for _ in range(config.num_disconnects):
        out.append(PlannedRequest(0, at(), "disconnect", ids(rng.randint(16, 200)),
                                  max_tokens=32, ignore_eos=True))  # fmt: skip
    return out


def burst_times(faults: list[PlannedFault], num_bursts: int, duration: float) -> list[float]:
    """When the bursts go out: each at the moment of 15..85 % of the load that is farthest from
    every worker kill or freeze (and from the bursts placed before it).

    A burst proves admission control: the excess must get RESOURCE_EXHAUSTED. While a kill or a
    freeze leaves a role without a usable worker, the router answers UNAVAILABLE at once and
    each refused request frees its slot before the next arrives, so a burst then proves
    nothing; the other faults (Redis, KV stalls) leave both roles serving and may overlap it.
    """
    busy = [
        (f.at_s, f.at_s + f.duration_s + _RECOVERY_ALLOWANCE_S)
        for f in faults
        if f.kind in ("kill-prefill", "kill-decode", "stop", "long-stop")
    ]
    candidates = [duration * (0.15 + 0.7 * i / 200) for i in range(201)]
    out: list[float] = []
    for _ in range(num_bursts):
        windows = busy + [(t - _BURST_SPACING_S, t + _BURST_SPACING_S) for t in out]
        out.append(max(candidates, key=lambda t: _distance(t, windows)))
    return sorted(out)


def _distance(t: float, windows: list[tuple[float, float]]) -> float:
    """How far `t` is from the nearest window (0 inside one; infinite when there is none)."""
    gaps = [max(lo - t, t - hi, 0.0) for lo, hi in windows]
    return min(gaps, default=float("inf"))


def _fault_schedule(rng: random.Random, config: SoakConfig, duration: float) -> list[PlannedFault]:
    """Seeded fault times spread over 5..90 % of the load; every kind listed comes up early
    (one of each in random order first), then the rest in random order."""
    counts = config.fault_counts()
    first = [k for k, n in counts.items() if n > 0]
    rng.shuffle(first)
    rest = [k for k, n in counts.items() for _ in range(n - 1)]
    rng.shuffle(rest)
    kinds = first + rest
    n_prefill, n_decode = config.counts
    slots = sorted(rng.uniform(0.05, 0.9) * duration for _ in kinds)
    out = []
    for i, (kind, at) in enumerate(zip(kinds, slots, strict=True)):
        if kind == "kill-prefill":
            target = rng.randrange(n_prefill)
        elif kind == "kill-decode":
            target = rng.randrange(n_decode)
        elif kind in ("stop", "long-stop"):
            target = rng.randrange(n_prefill + n_decode)
        else:
            target = 0
        dur = 0.0
        if kind == "stop":
            dur = rng.uniform(config.stop_min_s, config.stop_max_s)
        elif kind == "long-stop":
            dur = config.long_stop_duration_s
        out.append(PlannedFault(i, at, kind, target, dur))
    return out


def with_stop_strings(plan: SoakPlan, texts: dict[int, str]) -> SoakPlan:
    """Give each request with a `stop_at` a stop string cut from its reference output text
    (`texts[index]`, the text it would produce without stop strings) at that fraction, so the
    stop triggers; a request whose text is too short to cut from keeps none."""
    out = []
    for r in plan.requests:
        text = texts.get(r.index, "")
        if r.stop_at is None or len(text.strip()) < 4:
            out.append(r)
            continue
        start = min(int(len(text) * r.stop_at), len(text) - 3)
        snippet = text[start : start + 3]
        out.append(replace(r, stop=(snippet, "§never-in-output§")) if snippet.strip() else r)
    return replace(plan, requests=tuple(out))
