"""The evidence the ratio controller decides on: sampling noise, which phase limits attainment.
Router process; pure functions of a `MetricsWindow` and the config (no I/O, no clock).

- `wilson_upper` / `dropped`: how much a share of few requests can be trusted;
- `phase_attainment`: the attainment of the SLO a role answers for;
- `shortfall`: whether attainment is short of the band by more than sampling noise (rule 3);
- `queued` / `waits_for` / `bottleneck`: which role requests wait for, and why (rule 3 of
  `router.ratio.controller`).
"""

from __future__ import annotations

import math
from typing import Literal

from router.ratio.config import RatioConfig
from router.ratio.metrics import MetricsWindow

Phase = Literal["prefill", "decode"]


def wilson_upper(p: float, n: int, z: float) -> float:
    """Upper end of the Wilson score interval of a share `p` of `n` (1.0 for n = 0): unlike
    p + z * sqrt(p(1-p)/n) it stays honest at p = 0 ("0 of 4" is evidence, not certainty)."""
    if n <= 0:
        return 1.0
    d = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / d
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return min(1.0, centre + half)


def dropped(before: float, n_before: int, after: float, n_after: int, band: float) -> bool:
    """True when a share fell from `before` (of `n_before`) to `after` (of `n_after`) by more
    than `band` *and* by more than sampling noise explains (two-proportion z-test, z = 1.96):
    with a handful of requests per window one request more or less is not evidence."""
    diff = before - after
    if diff <= band or n_before < 1 or n_after < 1:
        return False
    pooled = (before * n_before + after * n_after) / (n_before + n_after)
    se = math.sqrt(pooled * (1 - pooled) * (1 / n_before + 1 / n_after))
    return diff > 1.96 * se


def attainment_text(window: MetricsWindow) -> str:
    """'attainment 80% of 10 requests': how every decision's reason starts."""
    return f"attainment {window.attainment:.0%} of {window.requests} requests"


def shortfall(window: MetricsWindow, config: RatioConfig) -> str:
    """'' when the window's both-SLO attainment is below `attainment_target - hysteresis` with
    at least `min_requests` requests and beyond sampling noise (the upper end of its Wilson
    interval at `evidence_z` is below the band too); else why not, as a hold reason (meets
    target / inside the dead band / too few requests / within noise)."""
    target, band = config.attainment_target, config.hysteresis
    att = attainment_text(window)
    if window.attainment < target - band:
        if window.requests < config.min_requests:
            return f"{att}: fewer than min_requests={config.min_requests}"
        upper = wilson_upper(window.attainment, window.requests, config.evidence_z)
        if upper >= target - band:
            return (
                f"{att} below target, but within sampling noise of the band (upper bound "
                f"{upper:.0%} at z={config.evidence_z:g}): wait for more requests"
            )
        return ""
    if window.attainment >= target:
        return f"{att} meets target {target:.0%}"
    return f"{att} inside the dead band {target - band:.0%}..{target:.0%}"


def phase_attainment(window: MetricsWindow, role: Phase) -> float:
    """The attainment of the SLO a role is responsible for: TTFT (prefill), TPOT (decode)."""
    return window.ttft_attainment if role == "prefill" else window.decode_attainment


def queued(window: MetricsWindow, role: Phase, config: RatioConfig) -> bool:
    """Whether requests wait for `role`: its workers hold a queue of `backlog` requests each
    on average (decode also when its KV is saturated: reservations start to fail). Decode's
    queue is `MetricsWindow.decode_waiting`: reservations still receiving KV are not in it."""
    if role == "prefill":
        return window.prefill_workers > 0 and window.prefill_waiting >= config.backlog
    return window.decode_workers > 0 and (
        window.decode_waiting >= config.backlog or window.decode_kv_utilisation >= config.kv_high
    )


def waits_for(window: MetricsWindow, config: RatioConfig) -> Phase | None:
    """The role requests wait for, by the queues: decode when decode workers hold the longer
    queue (at least `backlog` requests each) or their KV is saturated with no prefill queue;
    else prefill when it has a queue; else None. A queue is counted in requests per worker of
    its role, so the comparison does not depend on how fast either role is."""
    pre_q, dec_q = queued(window, "prefill", config), queued(window, "decode", config)
    longer = window.decode_waiting >= config.backlog and (
        window.decode_waiting > window.prefill_waiting
    )
    kv_full = window.decode_workers > 0 and window.decode_kv_utilisation >= config.kv_high
    if dec_q and (longer or (kv_full and not pre_q)):
        return "decode"
    return "prefill" if pre_q else None


def bottleneck(window: MetricsWindow, config: RatioConfig) -> tuple[Phase | None, str]:
    """The phase that limits attainment (or None) and why (rule 3 of the module docstring).

    TTFT misses are the prefill's doing unless the queues say requests wait for decode
    (`waits_for`): then they wait for decode capacity — at the router's admission, or for a
    reservation — and miss TTFT there. TPOT misses (of the requests that reached decode) are
    decode's. Saturated KV with both missing alike and no prefill queue means decode."""
    ttft_miss = 1.0 - window.ttft_attainment
    tpot_miss = 1.0 - window.decode_attainment
    misses = f"TTFT miss {ttft_miss:.0%}, TPOT miss {tpot_miss:.0%}"
    pre_q = queued(window, "prefill", config)
    queues = (
        f"prefill queue {window.prefill_waiting:.1f} requests "
        f"({window.prefill_waiting_tokens:.0f} tokens)/worker, decode queue "
        f"{window.decode_waiting:.1f} requests/worker (+{window.decode_receiving:.1f} receiving "
        f"KV), decode KV utilisation "
        f"{window.decode_kv_utilisation:.0%}"
    )
    if ttft_miss - tpot_miss > config.hysteresis:
        if waits_for(window, config) == "decode":
            return "decode", f"{misses}, but requests wait for decode: {queues}"
        return "prefill", f"{misses}; {queues}"
    if tpot_miss - ttft_miss > config.hysteresis:
        return "decode", f"{misses}; decode batch {window.decode_batch:.1f}/worker; {queues}"
    if window.decode_workers and window.decode_kv_utilisation >= config.kv_high and not pre_q:
        return "decode", (
            f"decode KV utilisation {window.decode_kv_utilisation:.0%} >= kv_high "
            f"{config.kv_high:.0%} ({misses})"
        )
    return None, f"{misses}: within hysteresis {config.hysteresis:.0%} of each other"
