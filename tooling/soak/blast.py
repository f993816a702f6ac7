"""The soak's blast-radius check: every request that did not complete exactly must be explained.
Pure (no I/O, no clock); runs in the soak process after the load, on the `check.judge` verdicts.

A request judged `status` (it ended with a clear status and every token it got was right) is
*explained* by exactly one of, first match wins:

- `own cancel`: CANCELLED, and this client cancelled it (or reset its connection);
- `own deadline`: DEADLINE_EXCEEDED, and the request carried its own (short) deadline;
- `fault <i> (<kind> <worker>)`: an injected fault overlapped it in time (`FaultWindow`: from
  the fault until the worker was back, plus `DETECT_GRACE_S` for the router to notice) on a
  worker the router placed it on (`Outcome.workers`, from the router's own record);
- `outage of every <role> worker`: at some moment of its life every worker of one role was
  inside a fault window (the router then has nowhere to send it);
- `shed in burst <b>` (RESOURCE_EXHAUSTED only): it arrived while a burst's requests were
  still running, or it was one of them; `shed during fault <i>` while a fault window was open
  (a stopped or dead worker holds admitted requests, so the queue fills).

Anything else — UNAVAILABLE or DEADLINE_EXCEEDED with no fault near it, a shed with no burst —
is `unexplained`, and fails the soak as a wrong token does: one client's deadline, body or
disconnect must not cost another client its request. A Redis restart explains nothing (the
prefix index is a hint; requests must not fail for it).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tooling.soak.check import Verdict
from tooling.soak.client import Outcome
from tooling.soak.faults import FaultRecord
from tooling.soak.workload import PlannedRequest

DETECT_GRACE_S = 1.0
"""After a fault ends, how long requests may still fail of it: the router's status poll
(0.25 s) and one failed call to notice a worker is back or gone."""

_WORKER_FAULTS = ("kill-prefill", "kill-decode", "stop", "long-stop", "kv-stall")


@dataclass(frozen=True)
class FaultWindow:
    """When one worker fault could fail requests: [start_s, end_s] on `worker`."""

    index: int
    kind: str
    worker: str
    start_s: float
    end_s: float


def fault_windows(records: Sequence[FaultRecord], end_of_run_s: float) -> list[FaultWindow]:
    """The window of every worker fault that was carried out (skipped ones and Redis restarts
    have none): a kill lasts until the worker served again (`rejoined_s`; never: the end of the
    run), a SIGSTOP its duration; each plus `DETECT_GRACE_S`."""
    out = []
    for r in records:
        if r.kind not in _WORKER_FAULTS or r.target == "?" or "skipped" in r.detail:
            continue
        if r.kind.startswith("kill"):
            end = r.rejoined_s if r.rejoined_s is not None else end_of_run_s
        else:
            end = r.time_s + r.duration_s
        out.append(FaultWindow(r.index, r.kind, r.target, r.time_s, end + DETECT_GRACE_S))
    return out


def _overlaps(lo: float, hi: float, o: Outcome) -> bool:
    return lo <= o.ended_at and o.sent_at <= hi


def _role_outage(
    o: Outcome, windows: Sequence[FaultWindow], roles: Mapping[str, str]
) -> str | None:
    """A role all of whose workers were inside fault windows at one moment of `o`'s life."""
    by_role: dict[str, list[str]] = {}
    for worker, role in roles.items():
        by_role.setdefault(role, []).append(worker)
    live = [w for w in windows if _overlaps(w.start_s, w.end_s, o)]
    # the moments that matter: `o`'s start and every window start inside its life
    moments = [o.sent_at] + [w.start_s for w in live if w.start_s >= o.sent_at]
    for t in moments:
        down = {w.worker for w in live if w.start_s <= t <= w.end_s}
        for role, workers in sorted(by_role.items()):
            if workers and set(workers) <= down:
                return role
    return None


def explain(
    r: PlannedRequest,
    o: Outcome,
    windows: Sequence[FaultWindow],
    roles: Mapping[str, str],
    bursts: Mapping[int, tuple[float, float]],
) -> str | None:
    """Why `r` (judged `status`) did not complete, or None when nothing explains it (module
    docstring). `roles`: worker id -> role; `bursts`: burst -> (first sent, last ended)."""
    if o.code == "CANCELLED" and o.client_cancelled:
        return "own cancel"
    if o.code == "DEADLINE_EXCEEDED" and r.timeout_s is not None:
        return "own deadline"
    for w in windows:
        if w.worker in o.workers and _overlaps(w.start_s, w.end_s, o):
            return f"fault {w.index} ({w.kind} {w.worker})"
    role = _role_outage(o, windows, roles)
    if role is not None:
        return f"outage of every {role} worker"
    if o.code == "RESOURCE_EXHAUSTED":
        if r.burst is not None:
            return f"shed in burst {r.burst}"
        for b, (lo, hi) in sorted(bursts.items()):
            if _overlaps(lo, hi, o):
                return f"shed in burst {b}"
        for w in windows:
            if _overlaps(w.start_s, w.end_s, o):
                return f"shed during fault {w.index} ({w.kind} {w.worker})"
    return None


def burst_spans(
    requests: Sequence[PlannedRequest], outcomes: Sequence[Outcome]
) -> dict[int, tuple[float, float]]:
    """Per burst: (first request sent, last request ended)."""
    spans: dict[int, tuple[float, float]] = {}
    for r, o in zip(requests, outcomes, strict=True):
        if r.burst is None:
            continue
        lo, hi = spans.get(r.burst, (o.sent_at, o.ended_at))
        spans[r.burst] = (min(lo, o.sent_at), max(hi, o.ended_at))
    return spans


def classify(
    requests: Sequence[PlannedRequest],
    outcomes: Sequence[Outcome],
    verdicts: Sequence[Verdict],
    records: Sequence[FaultRecord],
    roles: Mapping[str, str],
) -> list[Verdict]:
    """`verdicts` with every `status` one turned `explained` (its cause as the detail) or
    `unexplained`; the others as they were."""
    end = max((o.ended_at for o in outcomes), default=0.0)
    windows = fault_windows(records, end)
    bursts = burst_spans(requests, outcomes)
    out = []
    for r, o, v in zip(requests, outcomes, verdicts, strict=True):
        if v.category != "status":
            out.append(v)
            continue
        cause = explain(r, o, windows, roles, bursts)
        if cause is None:
            where = ", ".join(o.workers) or "no worker"
            detail = f"{o.code} at {o.sent_at:.2f}..{o.ended_at:.2f} s on {where}: {o.details}"
            out.append(Verdict(v.index, "unexplained", detail[:300]))
        else:
            out.append(Verdict(v.index, "explained", f"{o.code}: {cause}"))
    return out
