"""The ratio controller's driver: samples, windows, decisions, actuation, the decision log.

Runs in the router process, as one task on its event loop (`RatioController.start`). Each
`sample_interval_s` it samples the pool's worker views; each `interval_s` it builds a window
(`MetricsAggregator.window`, counting nothing from before the last change completed), asks
the pure core (`controller.decide`) and records the answer:

- `adaptive`: a change runs as its own task (the drain can take seconds; sampling goes on),
  through the `Actuator`; a `done` or `failed` record follows. At most one change runs.
- `advisory`: the change is recorded with ``applied = false`` and nothing happens; the state
  still counts it as a change, so the cooldown spaces advice out as it would space changes.

In a hybrid cluster with online threshold control (`threshold`, a `router.hybrid.
LiveThreshold`), the core is `threshold.decide_with_threshold`, and a `threshold` decision is
applied at once in `evaluate` (`LiveThreshold.set`: the next request reads it; a `done` record
follows at once). The driver is the only writer of the live threshold.

The request path feeds outcomes with `observe(ttft_s, tpot_s, ok)` (sync, O(1), safe to call
from any coroutine of the loop). Records go to `records` (the last 1000), the log, and — when
`config.decisions_path` is set — one JSON line each, appended and flushed at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol

from router.hybrid import LiveThreshold
from router.policy import WorkerView
from router.ratio.actuator import ActuationError, Actuator
from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide
from router.ratio.metrics import MetricsAggregator, MetricsWindow, samples_from_views
from router.ratio.threshold import decide_with_threshold

log = logging.getLogger(__name__)

Event = Literal["decision", "done", "failed"]


class ViewSource(Protocol):
    """What the driver reads from the pool (`router.pool.WorkerPool` satisfies it)."""

    def views(self) -> list[WorkerView]: ...


@dataclass(frozen=True)
class DecisionRecord:
    """One line of the decision log. `t` is seconds since the controller started; `inputs`
    is the window the decision saw (`MetricsWindow.to_json()`); a `done` / `failed` record
    repeats its decision's `seq` in `decision_seq` and gives the time it took."""

    seq: int
    t: float
    wall_time: float
    event: Event
    mode: str
    action: str
    reason: str
    address: str | None = None
    from_role: str | None = None
    to_role: str | None = None
    also: tuple[str, ...] = ()  # further workers the same switch moves
    threshold_from: int | None = None  # a threshold move: the hybrid threshold before
    threshold_to: int | None = None  # ... and after
    local_prefill_max_tokens: int | None = None  # the live threshold now (None: not controlled)
    applied: bool = False
    prefill_workers: int = 0
    decode_workers: int = 0
    attainment: float | None = None
    decision_seq: int | None = None
    duration_s: float | None = None
    error: str = ""
    inputs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class RatioController:
    """Owns the aggregator, the core's state and the decision log (module docstring)."""

    def __init__(
        self,
        config: RatioConfig,
        pool: ViewSource,
        actuator: Actuator | None = None,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        threshold: LiveThreshold | None = None,
    ) -> None:
        """`threshold`: the router's live hybrid threshold, moved by this controller (its
        bounds must be set: `HybridConfig.adaptive`); None: roles only."""
        if threshold is not None and not threshold.bounds.adaptive:
            raise ValueError(
                "hybrid threshold control needs max_local_prefill_max_tokens > 0 ([router.hybrid])"
            )
        if not config.enabled:
            raise ValueError("ratio.mode is 'fixed': there is no controller to run")
        if config.mode == "adaptive" and actuator is None:
            raise ValueError("ratio.mode 'adaptive' needs an actuator")
        self.config = config
        self.state = ControllerState()
        self.records: deque[DecisionRecord] = deque(maxlen=1000)
        self._pool = pool
        self._actuator = actuator
        self._clock = clock
        self._wall = wall_clock
        self._t0 = clock()
        self._agg = MetricsAggregator(config.window_s, config.slo_ttft_s, config.slo_tpot_s)
        self.threshold = threshold
        self._seq = 0
        self._next_eval: float | None = None  # when `tick` evaluates next
        self._task: asyncio.Task[None] | None = None
        self._change: asyncio.Task[None] | None = None
        self.on_decision: Callable[[str], None] | None = None
        """Told the action of every decision (`hold` included): the router's metrics."""

    # ---- inputs ----------------------------------------------------------------------------

    def observe(
        self,
        ttft_s: float | None,
        tpot_s: float | None,
        ok: bool,
        e2e_s: float | None = None,
        path: str = "",
    ) -> None:
        """One request ended now: its TTFT and TPOT in seconds (None when not measured),
        whether it succeeded (status OK with every token), how long it took in all (None:
        unknown — it then never counts in a window after a change), and where it was
        prefilled (hybrid: 'local' / 'remote'; '' otherwise)."""
        self._agg.observe(self._clock(), ttft_s, tpot_s, ok, e2e_s, path)

    def sample(self) -> None:
        """Take one worker-load sample from the pool now."""
        now = self._clock()
        self._agg.add_samples(now, samples_from_views(self._pool.views(), now))

    def window(self) -> MetricsWindow:
        """The window a decision made now would see."""
        return self._agg.window(self._clock(), self.state.last_change_end)

    # ---- one evaluation --------------------------------------------------------------------

    async def evaluate(self) -> DecisionRecord | None:
        """Decide once; record it; start the change (adaptive) — the change's task runs on.
        Returns the record (None for an unrecorded hold)."""
        now = self._clock()
        window = self.window()
        if self.threshold is None:
            decision = decide(window, self.state, now, self.config)
        else:
            live = self.threshold
            decision = decide_with_threshold(
                window, self.state, now, self.config, live.bounds, live.value
            )
        if decision.action == "hold":
            if not self.config.record_holds:
                return None
            return self._record("decision", decision, window, applied=False)
        adaptive = self.config.mode == "adaptive"
        rec = self._record("decision", decision, window, applied=adaptive)
        self.state.begin(decision, now, window)
        if not adaptive:
            self.state.end(now, ok=False)  # nothing changed: nothing to judge
            return rec
        if decision.action == "threshold":
            self._move_threshold(decision, rec, window)
            return rec
        self._change = asyncio.create_task(self._apply(decision, rec), name="ratio-change")
        return rec

    async def wait_idle(self) -> None:
        """Wait until no change is running (tests, shutdown)."""
        if self._change is not None:
            await asyncio.shield(self._change)

    def _move_threshold(self, d: Decision, rec: DecisionRecord, window: MetricsWindow) -> None:
        """Apply a `threshold` decision now: nothing drains, the next request reads it."""
        assert self.threshold is not None and d.threshold_to is not None, d
        self.threshold.set(d.threshold_to)
        end = self._clock()
        self.state.end(end, ok=True)
        self._record("done", d, window, applied=True, decision_seq=rec.seq, duration_s=0.0)

    async def _apply(self, d: Decision, rec: DecisionRecord) -> None:
        assert self._actuator is not None
        t0 = self._clock()
        error = ""
        address = d.address
        try:
            assert d.action == "switch" and d.address is not None and d.to_role is not None
            role, drain = d.to_role, self.config.drain_timeout_s
            # several workers drain side by side; the change completes when all are done
            done = await asyncio.gather(
                *(self._actuator.switch_role(a, role, drain) for a in d.addresses),
                return_exceptions=True,
            )
            failed = [e for e in done if isinstance(e, BaseException)]
            if failed:
                raise failed[0]
        except ActuationError as exc:
            error = str(exc)
        except asyncio.CancelledError:
            error = "cancelled: the controller stopped (a draining worker still switches)"
            raise
        except Exception as exc:  # a bug in an actuator must not stop the controller
            log.exception("ratio change %s failed unexpectedly", d)
            error = f"unexpected: {exc!r}"
        finally:
            end = self._clock()
            self.state.end(end, ok=not error)
            self.sample()  # the done record shows the cluster after the change
            event: Event = "failed" if error else "done"
            self._record(
                event,
                d,
                self.window(),
                applied=not error,
                decision_seq=rec.seq,
                duration_s=end - t0,
                error=error,
                address=address,
            )

    def _record(
        self,
        event: Event,
        d: Decision,
        window: MetricsWindow,
        applied: bool,
        decision_seq: int | None = None,
        duration_s: float | None = None,
        error: str = "",
        address: str | None = None,
    ) -> DecisionRecord:
        self._seq += 1
        rec = DecisionRecord(
            seq=self._seq,
            t=self._clock() - self._t0,
            wall_time=self._wall(),
            event=event,
            mode=self.config.mode,
            action=d.action,
            reason=d.reason,
            address=address or d.address,
            from_role=d.from_role,
            to_role=d.to_role,
            also=d.also,
            threshold_from=d.threshold_from,
            threshold_to=d.threshold_to,
            local_prefill_max_tokens=None if self.threshold is None else self.threshold.value,
            applied=applied,
            prefill_workers=window.prefill_workers,
            decode_workers=window.decode_workers,
            attainment=window.attainment if window.requests else None,
            decision_seq=decision_seq,
            duration_s=duration_s,
            error=error,
            inputs=window.to_json(),
        )
        self.records.append(rec)
        if event == "decision" and self.on_decision is not None:
            self.on_decision(d.action)
        level = logging.DEBUG if d.action == "hold" else logging.INFO
        if error:
            level = logging.WARNING
        log.log(
            level, "ratio %s %s: %s%s", event, d.action, d.reason, f" ({error})" if error else ""
        )
        if self.config.decisions_path is not None:
            with open(self.config.decisions_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(rec.to_json()) + "\n")
        return rec

    # ---- the loop --------------------------------------------------------------------------

    async def tick(self) -> DecisionRecord | None:
        """One step of the loop: a sample now, and an evaluation when one is due (every
        `interval_s` of the controller's clock). `run` calls it every `sample_interval_s`; a
        simulator calls it on its own clock (the clock passed in) — no sleeping inside."""
        self.sample()
        now = self._clock()
        if self._next_eval is None:
            self._next_eval = self._t0 + self.config.interval_s
        if now < self._next_eval:
            return None
        self._next_eval += self.config.interval_s
        return await self.evaluate()

    async def run(self) -> None:
        """Sample every `sample_interval_s`, evaluate every `interval_s`, until cancelled."""
        self._next_eval = self._clock() + self.config.interval_s
        while True:
            await asyncio.sleep(self.config.sample_interval_s)
            try:
                await self.tick()
            except Exception:  # keep controlling: a dead controller would freeze the ratio
                log.exception("ratio controller evaluation failed")

    def start(self) -> None:
        """Start `run` as a task on the running loop."""
        assert self._task is None, "controller already started"
        log.info("ratio controller: %s", self.config.model_dump_json())
        self._task = asyncio.create_task(self.run(), name="ratio-controller")

    async def stop(self) -> None:
        """Stop the loop and cancel a change in flight (a worker already draining finishes
        its switch on its own; the pool's next poll shows the outcome)."""
        for task in (self._task, self._change):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._task = None
