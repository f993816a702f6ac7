"""Metric windows of the ratio controller: request outcomes + worker-load samples -> a window.

Runs in the router process, on its event loop (pure code: no I/O, no clock of its own; every
call gets `now`). Two inputs:

- request outcomes (`RequestOutcome`): TTFT, TPOT and whether the request succeeded, fed by
  the router's request path through `MetricsAggregator.observe` when a request ends;
- worker samples (`WorkerSample`): one per worker per sample tick, built from the pool's
  `WorkerView`s (`samples_from_views`).

`MetricsAggregator.window(now, since)` folds the last `window_s` seconds into one frozen
`MetricsWindow`, leaving out requests that *started* before `since` (the end of the last
change: their latency belongs to the old ratio) and samples taken before it: SLO attainment (the
goodput bench's definition: a request meets an SLO only when it succeeded; a one-token request
has no TPOT and meets that SLO), tail latencies, and per-role load means. Memory is bounded:
entries older than `window_s` are dropped on every call.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from router.policy import WorkerView


@dataclass(frozen=True)
class RequestOutcome:
    """One finished request as the router saw it. `ttft_s` None: no token arrived;
    `tpot_s` None: fewer than two tokens."""

    t: float  # when it finished (controller clock)
    ttft_s: float | None
    tpot_s: float | None
    ok: bool
    start: float = -math.inf  # when it started (-inf: unknown, counted as "before anything")
    path: str = ""  # hybrid: "local" | "remote" (`router.hybrid`); "" colocated or unknown


@dataclass(frozen=True)
class WorkerSample:
    """One worker at one sample tick."""

    t: float
    address: str
    role: str
    usable: bool
    draining: bool
    waiting_tokens: int
    num_waiting: int
    num_running: int
    kv_utilisation: float  # 1 - free / total blocks (0 when unknown)
    num_receiving: int = 0  # of num_waiting: reservations whose KV is still to arrive


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's load averaged over a window's samples (role and flags: latest sample)."""

    address: str
    role: str
    usable: bool
    draining: bool
    waiting_tokens: float
    num_waiting: float
    num_running: float
    kv_utilisation: float
    num_receiving: float = 0.0  # of num_waiting: reservations whose KV is still to arrive

    @property
    def requests(self) -> float:
        """Mean requests held (running + waiting)."""
        return self.num_running + self.num_waiting


@dataclass(frozen=True)
class MetricsWindow:
    """Everything one decision looks at. Attainments are in [0, 1] (1 with no requests);
    per-role means are over that role's workers in the latest sample (0 with none)."""

    start: float
    end: float
    requests: int
    ok: int
    ttft_attainment: float
    tpot_attainment: float
    attainment: float
    ttft_p90_ms: float | None
    tpot_p90_ms: float | None
    prefill_workers: int  # workers in the role now (draining ones included)
    decode_workers: int
    prefill_waiting_tokens: float  # mean queued prompt tokens per prefill worker
    prefill_requests: float  # mean running + waiting per prefill worker
    decode_kv_utilisation: float  # mean over decode workers
    decode_batch: float  # mean running requests per decode worker
    decode_requests: float  # mean running + waiting per decode worker
    workers: tuple[WorkerLoad, ...] = ()
    # TPOT attainment of the requests that got a first token (None: as `tpot_attainment`):
    # a request shed or failed before it tells nothing about decode
    tpot_reached_attainment: float | None = None
    prefill_waiting: float = 0.0  # mean requests waiting per prefill worker
    local_requests: int = 0  # requests prefilled on their decode worker (hybrid local path)
    # mean reservations per decode worker whose KV is still to arrive (counted in
    # `decode_requests`): their prompts wait for a prefill worker, so they are prefill's backlog
    decode_receiving: float = 0.0

    @property
    def decode_waiting(self) -> float:
        """Mean requests per decode worker waiting for a batch slot (prefilled, not running).
        Reservations still receiving KV are not among them (`decode_receiving`): a decode
        worker holding only those has no queue of its own; they wait for prefill."""
        return max(0.0, self.decode_requests - self.decode_batch - self.decode_receiving)

    @property
    def decode_attainment(self) -> float:
        """TPOT attainment of the requests decode was responsible for."""
        if self.tpot_reached_attainment is None:
            return self.tpot_attainment
        return self.tpot_reached_attainment

    def count(self, role: str) -> int:
        """Workers now in `role` ('prefill' or 'decode')."""
        return self.prefill_workers if role == "prefill" else self.decode_workers

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict (floats rounded for the decision log)."""

        def rnd(v: Any) -> Any:
            return round(v, 4) if isinstance(v, float) else v

        out = {k: rnd(v) for k, v in asdict(self).items() if k != "workers"}
        out["workers"] = [{k: rnd(v) for k, v in asdict(w).items()} for w in self.workers]
        return out


def samples_from_views(views: Iterable[WorkerView], t: float) -> list[WorkerSample]:
    """One `WorkerSample` per view (prefill and decode roles only)."""
    out = []
    for v in views:
        if v.role not in ("prefill", "decode"):
            continue
        util = 1.0 - v.free_blocks / v.total_blocks if v.total_blocks > 0 else 0.0
        out.append(
            WorkerSample(
                t=t,
                address=v.address,
                role=v.role,
                usable=v.usable,
                draining=v.draining,
                waiting_tokens=v.waiting_tokens,
                num_waiting=v.num_waiting,
                num_running=v.num_running,
                kv_utilisation=util,
                num_receiving=v.num_receiving,
            )
        )
    return out


def _p90_ms(xs: Sequence[float]) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return 1e3 * s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


class MetricsAggregator:
    """Keeps the last `window_s` seconds of outcomes and samples; builds windows.

    `slo_ttft_s` / `slo_tpot_s` judge each outcome. Not thread-safe: call from one loop.
    """

    def __init__(self, window_s: float, slo_ttft_s: float, slo_tpot_s: float) -> None:
        if window_s <= 0 or slo_ttft_s <= 0 or slo_tpot_s <= 0:
            raise ValueError(
                f"window_s, slo_ttft_s and slo_tpot_s must be > 0, got {window_s}, "
                f"{slo_ttft_s}, {slo_tpot_s}"
            )
        self.window_s = window_s
        self.slo_ttft_s = slo_ttft_s
        self.slo_tpot_s = slo_tpot_s
        self._outcomes: deque[RequestOutcome] = deque()
        self._samples: deque[list[WorkerSample]] = deque()

    def observe(
        self,
        t: float,
        ttft_s: float | None,
        tpot_s: float | None,
        ok: bool,
        e2e_s: float | None = None,
        path: str = "",
    ) -> None:
        """Record one request that finished at `t` after `e2e_s` seconds (None: unknown; it
        then counts as started before any change), prefilled on `path` (hybrid: 'local' /
        'remote'). Call in finish order."""
        start = t - e2e_s if e2e_s is not None else -math.inf
        self._outcomes.append(RequestOutcome(t, ttft_s, tpot_s, ok, start, path))

    def add_samples(self, t: float, samples: list[WorkerSample]) -> None:
        """Record one sample tick (every worker's sample at time `t`)."""
        self._samples.append(samples)
        self._trim(t)

    def meets(self, o: RequestOutcome) -> tuple[bool, bool]:
        """(meets TTFT SLO, meets TPOT SLO) for one outcome."""
        ttft_ok = o.ok and o.ttft_s is not None and o.ttft_s <= self.slo_ttft_s
        tpot_ok = o.ok and (o.tpot_s is None or o.tpot_s <= self.slo_tpot_s)
        return ttft_ok, tpot_ok

    def _trim(self, now: float) -> None:
        horizon = now - self.window_s
        while self._outcomes and self._outcomes[0].t < horizon:
            self._outcomes.popleft()
        while self._samples and (not self._samples[0] or self._samples[0][0].t < horizon):
            self._samples.popleft()

    def window(self, now: float, since: float | None = None) -> MetricsWindow:
        """The window ending at `now`: the last `window_s` seconds, and nothing before `since`."""
        self._trim(now)
        start = now - self.window_s if since is None else max(now - self.window_s, since)
        outs = [o for o in self._outcomes if o.t >= start]
        if since is not None:
            outs = [o for o in outs if o.start >= since]
        n = len(outs)
        met = [self.meets(o) for o in outs]
        ttft_n = sum(a for a, _ in met)
        tpot_n = sum(b for _, b in met)
        reached = [b for o, (_, b) in zip(outs, met, strict=True) if o.ttft_s is not None]
        both_n = sum(a and b for a, b in met)
        ticks = [s for s in self._samples if s and s[0].t >= start]
        loads = _loads(ticks)
        pre = [w for w in loads if w.role == "prefill"]
        dec = [w for w in loads if w.role == "decode"]
        return MetricsWindow(
            start=start,
            end=now,
            requests=n,
            ok=sum(o.ok for o in outs),
            ttft_attainment=ttft_n / n if n else 1.0,
            tpot_attainment=tpot_n / n if n else 1.0,
            attainment=both_n / n if n else 1.0,
            ttft_p90_ms=_p90_ms([o.ttft_s for o in outs if o.ttft_s is not None]),
            tpot_p90_ms=_p90_ms([o.tpot_s for o in outs if o.tpot_s is not None]),
            prefill_workers=len(pre),
            decode_workers=len(dec),
            prefill_waiting_tokens=_mean([w.waiting_tokens for w in pre]),
            prefill_requests=_mean([w.requests for w in pre]),
            decode_kv_utilisation=_mean([w.kv_utilisation for w in dec]),
            decode_batch=_mean([w.num_running for w in dec]),
            decode_requests=_mean([w.requests for w in dec]),
            workers=tuple(loads),
            tpot_reached_attainment=sum(reached) / len(reached) if reached else 1.0,
            prefill_waiting=_mean([w.num_waiting for w in pre]),
            local_requests=sum(o.path == "local" for o in outs),
            decode_receiving=_mean([w.num_receiving for w in dec]),
        )


def _loads(ticks: Sequence[list[WorkerSample]]) -> list[WorkerLoad]:
    """Per-worker means over `ticks`, for the workers present in the latest tick (a worker's
    role is its latest one; samples from before a role switch are not averaged in)."""
    if not ticks:
        return []
    out = []
    for last in ticks[-1]:
        hist = [s for tick in ticks for s in tick if s.address == last.address]
        hist = [s for s in hist if s.role == last.role]
        out.append(
            WorkerLoad(
                address=last.address,
                role=last.role,
                usable=last.usable,
                draining=last.draining,
                waiting_tokens=_mean([s.waiting_tokens for s in hist]),
                num_waiting=_mean([s.num_waiting for s in hist]),
                num_running=_mean([s.num_running for s in hist]),
                kv_utilisation=_mean([s.kv_utilisation for s in hist]),
                num_receiving=_mean([s.num_receiving for s in hist]),
            )
        )
    return out
