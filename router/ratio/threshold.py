"""Online control of the hybrid local-prefill threshold: the ratio controller's second knob.

Runs in the router process, inside the ratio controller's driver; pure like `controller.decide`
(no I/O, no clock). In a hybrid cluster (`[router.hybrid]` with `max_local_prefill_max_tokens`
set) the driver asks `decide_with_threshold` instead of `decide`. It moves
`local_prefill_max_tokens` (prompts with at most that many uncached tokens prefill on their
decode worker, `router.hybrid`) by the same evidence, state and rules as role switches:

1. the gate of `controller.gate`: a change of *either* kind in progress, one started less than
   `interval_s` ago, or completed less than `cooldown_s` ago -> hold. Role switches and
   threshold moves share one `ControllerState`, so there is at most one change per interval in
   total, and every change starts the cooldown of both;
2. a role switch that made things worse is reverted first (`controller.decide`'s rule 2);
3. the last threshold move is judged once a full `window_s` has passed since it and
   `min_requests` requests finished after it (`revert_worse`): a raise made things worse when
   decode's TPOT attainment dropped (it sent more prefill work into decode batches), a lower
   when TTFT attainment dropped (more prompts wait for the prefill workers) — each by more than
   `hysteresis` and more than sampling noise (`evidence.dropped`). Then the threshold goes
   back and that direction is barred for `tabu_s`;
4. attainment must be short of the band (`evidence.shortfall`: below `attainment_target -
   hysteresis`, `min_requests`, beyond the Wilson interval) — else hold, inside the dead band;
5. with the bottleneck phase (`evidence.bottleneck`, the same hysteresis between the two miss
   rates):
   - **raise** when the bottleneck is prefill, requests queue on the prefill workers
     (`evidence.queued`), and decode has TPOT slack (decode attainment >= target - hysteresis,
     no decode queue — reservations still receiving KV are not one: their prompts are the
     prefill queue, `MetricsWindow.decode_waiting`): more prompts prefill where they decode,
     off the prefill queue;
   - **lower** when the bottleneck is decode and requests took the local path in the window
     (their prefill chunks ran inside decode batches and took decode time);
   - each by `threshold_step` (x or /, at least one token), clamped to
     `min_local_prefill_max_tokens` .. `max_local_prefill_max_tokens`; at a bound, or with the
     direction barred, no move;
6. the threshold is the cheaper knob (no drain, effective with the next request), so a move
   comes before a role switch; when it cannot move, `controller.decide`'s switch (if any)
   stands; else hold, the reason naming both.

Every answer is a `controller.Decision` (action `threshold` for a move) with a one-line reason
carrying its numbers; the driver records it like a role decision (`DecisionRecord`).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Literal

from router.hybrid import HybridConfig
from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide, gate
from router.ratio.evidence import (
    attainment_text,
    bottleneck,
    dropped,
    queued,
    shortfall,
)
from router.ratio.metrics import MetricsWindow

Direction = Literal["raise", "lower"]


def tabu_key(direction: Direction) -> tuple[str, str]:
    """The `ControllerState.tabu` key barring a threshold direction."""
    return ("threshold", direction)


def step(current: int, direction: Direction, bounds: HybridConfig) -> int:
    """The threshold one move in `direction` gives: x or / `threshold_step` (at least one
    token), clamped to the bounds."""
    lo, hi = bounds.min_local_prefill_max_tokens, bounds.max_local_prefill_max_tokens
    if direction == "raise":
        return min(hi, max(current + 1, math.ceil(current * bounds.threshold_step)))
    return max(lo, min(current - 1, math.floor(current / bounds.threshold_step)))


def decide_with_threshold(
    window: MetricsWindow,
    state: ControllerState,
    now: float,
    config: RatioConfig,
    bounds: HybridConfig,
    current: int,
) -> Decision:
    """The decision for `window` at `now` when the threshold (now `current`, bounds and step in
    `bounds`) moves too (rules in the module docstring). Writes to `state` only what
    `controller.decide` writes, and rule 3's bookkeeping (the move judged, a direction barred)."""
    assert bounds.adaptive, bounds
    why_not = gate(window, state, now, config)
    if why_not:
        return Decision("hold", why_not)
    roles = decide(window, state, now, config)
    if roles.revert:
        return roles
    judged = _judge(window, state, now, config, current)
    if judged is not None:
        return judged
    why_not = shortfall(window, config)
    if why_not:
        return Decision("hold", f"{why_not}; threshold {current}")
    moved, why = _move(window, state, now, config, bounds, current)
    if moved is not None:
        return moved
    return replace(roles, reason=f"{roles.reason}; threshold {current}: {why}")


def _judge(
    window: MetricsWindow, state: ControllerState, now: float, config: RatioConfig, current: int
) -> Decision | None:
    """Rule 3: the move back when the last threshold move made things worse, else None (and
    the move counts as judged once enough requests finished after it)."""
    last, before = state.last, state.before
    if last is None or last.action != "threshold" or before is None:
        return None
    if window.requests < config.min_requests:
        return None
    if state.last_change_end is not None and now - state.last_change_end < config.window_s:
        return None  # judge on a full window after the change
    state.last = None
    if not config.revert_worse:
        return None
    assert last.threshold_from is not None and last.threshold_to is not None
    direction: Direction = "raise" if last.threshold_to > last.threshold_from else "lower"
    n0, n1, band = before.requests, window.requests, config.hysteresis
    if direction == "raise":
        what, a0, a1 = "TPOT", before.decode_attainment, window.decode_attainment
    else:
        what, a0, a1 = "TTFT", before.ttft_attainment, window.ttft_attainment
    if not dropped(a0, n0, a1, n1, band):
        return None
    if current != last.threshold_to:
        return None  # moved since (by hand or a restart): nothing of ours to undo
    state.tabu[tabu_key(direction)] = now + config.tabu_s
    return Decision(
        "threshold",
        f"{attainment_text(window)}: the last threshold move ({last.threshold_from} -> "
        f"{last.threshold_to}) made it worse: {what} attainment fell ({a0:.0%} of {n0} -> "
        f"{a1:.0%} of {n1}); revert, and no {direction} for {config.tabu_s:g}s",
        revert=True,
        threshold_from=current,
        threshold_to=last.threshold_from,
    )


def _move(
    window: MetricsWindow,
    state: ControllerState,
    now: float,
    config: RatioConfig,
    bounds: HybridConfig,
    current: int,
) -> tuple[Decision | None, str]:
    """Rule 5: a raise or lower of the threshold, or None and why not."""
    att = attainment_text(window)
    need, why = bottleneck(window, config)
    low = config.attainment_target - config.hysteresis
    direction: Direction
    if need == "prefill":
        if not queued(window, "prefill", config):
            return None, f"TTFT misses but no prefill queue ({why})"
        dec = window.decode_attainment
        if dec < low or queued(window, "decode", config):
            return None, f"decode has no TPOT slack ({dec:.0%} TPOT attainment; {why})"
        direction, because = "raise", f"prefill is the bottleneck ({why}); decode has slack "
        because += f"({dec:.0%} TPOT attainment)"
    elif need == "decode":
        if window.local_requests == 0:
            return None, f"decode is the bottleneck but no request took the local path ({why})"
        direction = "lower"
        because = f"decode is the bottleneck ({why}); {window.local_requests} of "
        because += f"{window.requests} requests prefilled on their decode worker"
    else:
        return None, why
    target = step(current, direction, bounds)
    if target == current:
        bound = "max" if direction == "raise" else "min"
        return None, f"would {direction}, but at {bound}_local_prefill_max_tokens={current}"
    until = state.tabu.get(tabu_key(direction), -1.0)
    if until > now:
        return None, f"would {direction}, but that made it worse lately ({until - now:.0f}s more)"
    return Decision(
        "threshold",
        f"{att}; {because}: {direction} local_prefill_max_tokens {current} -> {target}",
        threshold_from=current,
        threshold_to=target,
    ), ""
