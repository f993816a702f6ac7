"""The ratio controller's pure core: `decide(window, state, now, config) -> Decision`.

Runs in the router process, inside the controller's driver (`driver.py`), once per
`interval_s`. No I/O, no clock: the same inputs always give the same decision, so tests drive
it with scripted windows. Every answer — changes *and* holds — carries a one-line reason that
names the numbers it used; the driver records it with the window (`DecisionRecord`).

The rules, in order (the first that applies wins):

1. a change is in progress -> hold; a change started less than `interval_s` ago -> hold
   (at most one change per interval); the last change completed less than `cooldown_s` ago ->
   hold; a worker is draining (a switch made elsewhere) -> hold;
2. the last switch is judged once a full `window_s` has passed since it completed and
   `min_requests` requests that started after it finished (`revert_worse`):
   it made things worse when the role that gave the worker now misses its SLO (attainment
   below target - hysteresis; it had slack before), or when a switch to decode lowered TPOT
   attainment — each drop by more than `hysteresis` and more than sampling noise (`dropped`:
   a two-proportion z-test at 95%). Then the same worker switches back and that
   direction is barred for `tabu_s`: on a shared CPU another worker of a role can add a
   process without adding capacity, and only the outcome tells. (A switch to prefill is not
   judged by TTFT: the queue built before it keeps TTFT high for a while whatever it does.
   A load change between the two windows can also explain a drop; the bar is temporary.)
3. attainment (both SLOs) below `attainment_target - hysteresis` even at the upper end of its
   Wilson interval at `evidence_z` (few requests are weak evidence, but 0 of 4 is not none),
   with at least `min_requests` finished requests in the window -> find the bottleneck phase
   (`bottleneck`): decode when decode KV utilisation >= `kv_high` (reservations start to
   fail), else the phase whose SLO miss rate exceeds the other's by more than `hysteresis`,
   else none (hold: both miss alike — nothing a ratio change can fix);
4. the needy role must be below its `max_*` bound. Then switch workers from the other role
   when that role is above its `min_*` bound and its own SLO attainment is inside the band
   (>= target - hysteresis; not required of prefill when decode KV is saturated, since that is
   what makes TTFT miss): the least-loaded usable workers of that role drain and switch —
   unless that direction is barred; else hold, saying which bound or which miss stopped it;
5. otherwise hold ("meets target" / "inside the dead band" / "too few requests").

The controller only moves workers between roles; adding and removing workers is left to the
launcher (the Ray autoscaler), not decided here. In a hybrid cluster with online threshold
control, `router.ratio.threshold.decide_with_threshold` wraps this function: the same state,
gate and rules also move `local_prefill_max_tokens` (a `threshold` decision); rule 2 here
judges only role switches, a threshold change is judged there.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from router.ratio.config import RatioConfig
from router.ratio.evidence import (
    attainment_text,
    bottleneck,
    dropped,
    phase_attainment,
    queued,
    shortfall,
    waits_for,
)
from router.ratio.metrics import MetricsWindow, WorkerLoad

Action = Literal["hold", "switch", "threshold"]
Phase = Literal["prefill", "decode"]


@dataclass(frozen=True)
class Decision:
    """What to do now. `switch`: `address` (and `also`) move `from_role` -> `to_role`;
    `threshold`: the hybrid local-prefill threshold goes `threshold_from` -> `threshold_to`
    (`router.ratio.threshold`); `hold`: nothing."""

    action: Action
    reason: str
    address: str | None = None
    from_role: Phase | None = None
    to_role: Phase | None = None
    revert: bool = False  # undoes the previous change (which made attainment worse)
    also: tuple[str, ...] = ()  # switch: further workers moved with `address`, the same way
    threshold_from: int | None = None  # threshold: the live value before
    threshold_to: int | None = None  # threshold: the value it is set to

    @property
    def addresses(self) -> tuple[str, ...]:
        """Every worker this decision moves (`address` first)."""
        return () if self.address is None else (self.address, *self.also)

    def __post_init__(self) -> None:
        assert not self.also or self.action == "switch", f"only a switch moves several: {self}"
        roles = self.action == "switch"
        moves = self.action == "threshold"
        need = (roles, roles, roles, moves, moves)
        have = (
            self.address is not None,
            self.from_role is not None,
            self.to_role is not None,
            self.threshold_from is not None,
            self.threshold_to is not None,
        )
        assert have == need, f"inconsistent decision {self}"
        assert not moves or self.threshold_from != self.threshold_to, f"no move: {self}"


@dataclass
class ControllerState:
    """What the core remembers between evaluations; the driver updates it via `begin`/`end`."""

    pending: Decision | None = None
    last_change_start: float | None = None
    last_change_end: float | None = None
    changes: int = 0
    last: Decision | None = None  # the last completed switch, until judged (rule 2)
    before: MetricsWindow | None = None  # the window the pending / last change was decided on
    tabu: dict[tuple[str, str], float] = field(default_factory=dict)  # (from, to) -> until
    streak: tuple[Phase, int] | None = None  # the last completed switch: (to_role, workers)

    def begin(self, decision: Decision, now: float, before: MetricsWindow | None = None) -> None:
        """A change starts (or, in advisory mode, is only advised) at `now`; `before` is the
        window it was decided on (what rule 2 compares with)."""
        assert self.pending is None, f"change {self.pending} still pending"
        assert decision.action != "hold", decision
        self.pending = decision
        self.last_change_start = now
        self.before = before

    def end(self, now: float, ok: bool = True) -> None:
        """The pending change completed (`ok`) or failed at `now`: the cooldown starts. A
        completed switch or threshold move that is not itself a revert waits to be judged."""
        assert self.pending is not None, "no change pending"
        done = self.pending
        self.pending = None
        self.last_change_end = now
        self.changes += 1
        judge = ok and done.action != "hold" and not done.revert and self.before is not None
        self.last = done if judge else None
        fed = ok and done.action == "switch" and not done.revert and done.to_role is not None
        self.streak = (done.to_role, len(done.addresses)) if fed and done.to_role else None


def _hold(reason: str) -> Decision:
    return Decision("hold", reason)


def _other(role: Phase) -> Phase:
    return "decode" if role == "prefill" else "prefill"


def _bound(config: RatioConfig, kind: str, role: Phase) -> int | None:
    value: int | None = getattr(config, f"{kind}_{role}")
    return value


def _by_load(workers: list[WorkerLoad]) -> list[WorkerLoad]:
    """Least loaded first (ties: address)."""
    return sorted(
        workers, key=lambda w: (w.requests, w.waiting_tokens, w.kv_utilisation, w.address)
    )


def step_size(
    window: MetricsWindow,
    state: ControllerState,
    now: float,
    config: RatioConfig,
    need: Phase,
    candidates: int,
) -> tuple[int, str]:
    """How many workers a switch toward `need` moves, and why (rule 4): 1, or twice the last
    switch's when that one fed `need` too and this one comes as soon as the cooldown let it
    (the shortfall outlasted the last step), capped by `max_step`, by half the donor role, by
    the donor's `min_*` and the needy role's `max_*` bound."""
    donor = _other(need)
    size, why = 1, ""
    if state.streak is not None and state.last_change_end is not None:
        role, last = state.streak
        soon = now - state.last_change_end <= config.cooldown_s + 2 * config.interval_s
        if role == need and soon:
            size, why = 2 * last, f"step {2 * last}: the last switch fed {need} too"
    donor_min = _bound(config, "min", donor)
    cap = _bound(config, "max", need)
    assert donor_min is not None
    limits = [
        config.max_step,
        max(1, window.count(donor) // 2),
        window.count(donor) - donor_min,
        candidates,
    ]
    if cap is not None:
        limits.append(cap - window.count(need))
    size = max(1, min([size, *limits]))
    return size, (why if size > 1 else "")


def gate(window: MetricsWindow, state: ControllerState, now: float, config: RatioConfig) -> str:
    """Rule 1: why no change may start now ('' when one may). Role switches and threshold
    moves share it: at most one change of either kind per interval and cooldown."""
    if state.pending is not None:
        p = state.pending
        if p.action == "threshold":
            return f"change in progress: threshold {p.threshold_from} -> {p.threshold_to}"
        return f"change in progress: {p.action} {p.address or ''} -> {p.to_role or ''}".strip()
    if state.last_change_start is not None and now - state.last_change_start < config.interval_s:
        return f"a change started {now - state.last_change_start:.1f}s ago (< interval_s)"
    if state.last_change_end is not None and now - state.last_change_end < config.cooldown_s:
        left = config.cooldown_s - (now - state.last_change_end)
        return f"cooldown: {left:.1f}s left"
    draining = [w.address for w in window.workers if w.draining]
    if draining:
        return f"worker(s) draining: {', '.join(draining)}"
    return ""


def decide(
    window: MetricsWindow, state: ControllerState, now: float, config: RatioConfig
) -> Decision:
    """The decision for `window` at `now` (see the module docstring for the rules). Reads
    `state`; its only writes are rule 2's bookkeeping: the last switch is marked judged
    (`state.last = None`) and a reverted direction is barred (`state.tabu`)."""
    why_not = gate(window, state, now, config)
    if why_not:
        return _hold(why_not)
    att = attainment_text(window)
    judged = _judge(window, state, now, config, att)
    if judged is not None:
        return judged
    why_not = shortfall(window, config)
    if why_not:
        return _hold(why_not)
    return _grow(window, state, now, config, att)


def _judge(
    window: MetricsWindow, state: ControllerState, now: float, config: RatioConfig, att: str
) -> Decision | None:
    """Rule 2: a revert of the last switch when it made attainment worse, else None (and the
    switch counts as judged once enough requests finished after it)."""
    last, before = state.last, state.before
    if last is None or last.action != "switch":
        return None  # a threshold move is judged by `router.ratio.threshold`
    if before is None or window.requests < config.min_requests:
        return None
    if state.last_change_end is not None and now - state.last_change_end < config.window_s:
        return None  # judge on a full window after the change
    assert last.to_role is not None
    if queued(window, last.to_role, config):
        return None  # the backlog the switch was to relieve is still there: judge it later
    state.last = None
    if not config.revert_worse:
        return None
    assert last.address is not None and last.from_role is not None and last.to_role is not None
    low = config.attainment_target - config.hysteresis
    donor_now, donor_before = (
        phase_attainment(window, last.from_role),
        phase_attainment(before, last.from_role),
    )
    n0, n1, band = before.requests, window.requests, config.hysteresis
    tpot0, tpot1 = before.tpot_attainment, window.tpot_attainment
    # TTFT misses while requests wait for decode are not the prefill's (rule 3)
    donor_own = last.from_role == "decode" or waits_for(window, config) != "decode"
    if (
        donor_own
        and donor_now < low <= donor_before
        and dropped(donor_before, n0, donor_now, n1, band)
    ):
        why = f"{last.from_role} now misses its SLO ({donor_before:.0%} -> {donor_now:.0%})"
    elif last.to_role == "decode" and dropped(tpot0, n0, tpot1, n1, band):
        why = f"TPOT attainment fell ({tpot0:.0%} of {n0} -> {tpot1:.0%} of {n1})"
    else:
        return None
    state.tabu[(last.from_role, last.to_role)] = now + config.tabu_s
    usable = {w.address for w in window.workers if w.usable and w.role == last.to_role}
    back = [a for a in last.addresses if a in usable]
    if not back:
        return None
    return Decision(
        "switch",
        f"{att}: the last switch ({', '.join(last.addresses)} {last.from_role} -> "
        f"{last.to_role}) made it worse: {why}; revert, and no {last.from_role} -> "
        f"{last.to_role} switch for {config.tabu_s:g}s",
        address=back[0],
        from_role=last.to_role,
        to_role=last.from_role,
        revert=True,
        also=tuple(back[1:]),
    )


def _grow(
    window: MetricsWindow, state: ControllerState, now: float, config: RatioConfig, att: str
) -> Decision:
    """Rules 3-4: more capacity for the bottleneck phase, by a switch."""
    need, why = bottleneck(window, config)
    if need is None:
        return _hold(f"{att} below target, no clear bottleneck: {why}")
    donor = _other(need)
    cap = _bound(config, "max", need)
    if cap is not None and window.count(need) >= cap:
        return _hold(f"{att}; need {need} ({why}) but max_{need}={cap} reached")
    donor_att = phase_attainment(window, donor)
    low = config.attainment_target - config.hysteresis
    # TTFT misses while requests wait for decode are not the prefill's doing; TPOT misses
    # always are decode's
    own_miss = donor_att < low and (donor == "decode" or waits_for(window, config) != "decode")
    donor_min = _bound(config, "min", donor)
    assert donor_min is not None
    candidates = [w for w in window.workers if w.role == donor and w.usable]
    blocked = ""
    if window.count(donor) <= donor_min:
        blocked = f"{donor} at min_{donor}={donor_min}"
    elif own_miss:
        blocked = f"{donor} misses its own SLO ({donor_att:.0%} < {low:.0%})"
    elif not candidates:
        blocked = f"no usable {donor} worker"
    elif state.tabu.get((donor, need), -1.0) > now:
        left = state.tabu[(donor, need)] - now
        blocked = f"{donor} -> {need} made attainment worse lately (barred {left:.0f}s more)"
    if not blocked:
        size, step_why = step_size(window, state, now, config, need, len(candidates))
        picks = [w.address for w in _by_load(candidates)[:size]]
        return Decision(
            "switch",
            f"{att}; {need} is the bottleneck ({why}); {donor} has slack "
            f"({donor_att:.0%} attainment): move least-loaded {', '.join(picks)}"
            + (f" ({step_why})" if step_why else ""),
            address=picks[0],
            from_role=donor,
            to_role=need,
            also=tuple(picks[1:]),
        )
    return _hold(f"{att}; need {need} ({why}) but {blocked}")
