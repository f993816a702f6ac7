"""Workloads for the planner and the ratio benchmark, from the goodput bench's generator.

Pure numpy (through `tooling.goodput.workloads`); runs in `pdserve plan` and the
benchmarks. The planner simulates exactly the requests a real run would send:

- `requests(name, n, rate, context, seed, output_len)`: `make_requests` of the goodput bench
  (same lengths, same Poisson arrivals for the same seed);
- `shifting(phases, context, seed)`: phases run back to back, e.g.
  ``[("chat", 4.0, 60.0), ("summarize", 1.0, 60.0)]`` = chat at 4 req/s for 60 s, then
  summarize at 1 req/s for 60 s; each phase is its own seeded draw, cut at its duration and
  shifted to start where the previous one ended; indexes are renumbered. A phase's workload
  may carry its own length budget: ``"chat@8192"`` draws chat lengths for L = 8192;
- `to_sim(specs)`: the simulator's view of a request list; `phase_starts(phases)`: when each
  phase begins;
- `parse_phases("chat:4:60,summarize:1:60")`: the CLI's spelling of phases.
"""

from __future__ import annotations

import dataclasses
import math

from tooling.goodput.records import RequestSpec
from tooling.goodput.workloads import WORKLOADS, make_requests
from tooling.planner.sim import SimRequest

Phase = tuple[str, float, float]  # (workload, rate req/s, duration s)


def requests(
    name: str,
    n: int,
    rate: float,
    context: int,
    seed: int = 0,
    output_len: int | None = None,
) -> list[RequestSpec]:
    """`n` requests of workload `name` at `rate` (the goodput bench's `make_requests`)."""
    return make_requests(name, n, rate, context=context, seed=seed, output_len=output_len)


def shifting(
    phases: list[Phase], context: int, seed: int = 0, output_len: int | None = None
) -> list[RequestSpec]:
    """Phases back to back (module docstring). ValueError names a bad phase."""
    out: list[RequestSpec] = []
    t0 = 0.0
    for k, (label, rate, duration) in enumerate(phases):
        name, ctx = phase_workload(label, context)
        if name not in WORKLOADS or rate <= 0 or duration <= 0:
            raise ValueError(
                f"phase {k}: need a workload in {sorted(WORKLOADS)}, rate > 0 and duration > 0, "
                f"got ({label!r}, {rate}, {duration})"
            )
        n = max(1, math.ceil(rate * duration * 1.5) + 10)
        specs = make_requests(
            name, n, rate, context=ctx, seed=seed + 1000 * k, output_len=output_len
        )
        for s in specs:
            if s.arrival_s >= duration:
                break
            out.append(dataclasses.replace(s, index=len(out), arrival_s=t0 + s.arrival_s))
        t0 += duration
    return out


def phase_workload(label: str, context: int) -> tuple[str, int]:
    """'chat@8192' -> ('chat', 8192); 'chat' -> ('chat', `context`). ValueError on a bad
    context."""
    name, _, ctx = label.partition("@")
    if not ctx:
        return name, context
    try:
        value = int(ctx)
    except ValueError:
        raise ValueError(f"phase {label!r}: the context after '@' must be an integer") from None
    if value < 16:
        raise ValueError(f"phase {label!r}: context must be >= 16, got {value}")
    return name, value


def phase_starts(phases: list[Phase]) -> list[tuple[float, str]]:
    """[(start s, workload name)] of back-to-back phases."""
    out, t = [], 0.0
    for name, _, duration in phases:
        out.append((t, name))
        t += duration
    return out


GROUP_TOKEN = 1 << 40  # + prefix group: the token of a group's shared stream
PRIVATE_TOKEN = 1 << 41  # + position: the token of one request's own part


def to_sim(specs: list[RequestSpec]) -> list[SimRequest]:
    """The simulator's requests (arrival, prompt, output) in the same order. A request of a
    prefix group gets token ids, so the simulated prefix caches hit as the engine's would:
    its first `prefix_len` tokens (all, when None) are its group's stream, the rest its own;
    other requests have private prompts (no token ids)."""
    out = []
    for i, s in enumerate(specs):
        tokens: tuple[int, ...] = ()
        if s.prefix_group is not None:
            shared = s.input_len if s.prefix_len is None else s.prefix_len
            own = s.input_len - shared
            tokens = (GROUP_TOKEN + s.prefix_group,) * shared + (PRIVATE_TOKEN + i,) * own
        out.append(SimRequest(s.arrival_s, s.input_len, s.output_len, tokens))
    return out


def parse_phases(text: str) -> list[Phase]:
    """'chat:4:60,summarize@2048:1:60' -> [("chat", 4.0, 60.0), ("summarize@2048", 1.0, 60.0)]."""
    phases: list[Phase] = []
    for part in text.split(","):
        bits = part.strip().split(":")
        if len(bits) != 3:
            raise ValueError(f"phase must be WORKLOAD:RATE:SECONDS, got {part!r}")
        phases.append((bits[0], float(bits[1]), float(bits[2])))
    return phases
