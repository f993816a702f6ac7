"""Ratio-tuning configuration (`RatioConfig`): how the prefill:decode ratio controller behaves.

Runs in the router process and in the CLI (torch-free). Frozen pydantic v2; every field is
described and defaulted. In a cluster TOML it is the ``[ratio]`` table::

    [ratio]
    mode = "adaptive"             # "fixed" (controller off) | "adaptive" | "advisory" (log only)
    slo_ttft_ms = 2000            # both SLOs are required unless mode = "fixed"
    slo_tpot_ms = 100
    attainment_target = 0.9       # share of requests that must meet both SLOs
    min_prefill = 1               # bounds on each role's worker count
    max_prefill = 3
    min_decode = 1
    max_decode = 3
    window_s = 10                 # observation window (outcomes + worker samples)
    interval_s = 2                # evaluation period: at most one change per interval
    cooldown_s = 10               # quiet time after a change completes
    hysteresis = 0.05             # attainment points of dead band around the target

How the fields interact (what `decide` in `controller.py` does with them): every `interval_s`
the controller looks at the last `window_s` seconds, counting only requests that *finished
after the last change completed*; it acts when both-SLO attainment is below
`attainment_target - hysteresis` and at least `min_requests` requests finished, never within
`cooldown_s` of the previous change, and never outside the bounds. The controller only moves
workers between roles; adding and removing workers is the launcher's (Ray autoscaler's) job.
In a hybrid cluster whose `[router.hybrid]` sets `max_local_prefill_max_tokens`, it also moves
the local-prefill threshold (`router.ratio.threshold`), by these same interval, cooldown,
hysteresis, evidence and revert/tabu settings; the threshold's bounds and step are
`[router.hybrid]` keys (`router.hybrid.HybridConfig`).
The keys of the scaling that was never built (``allow_scale_out``, ``allow_scale_in``,
``scale_in_load``, ``max_workers``) still load, with one warning each per process;
``allow_scale_out = true`` or ``allow_scale_in = true`` is refused.

Invalid combinations raise at start (pydantic `ValidationError`, message naming the fields).
`check_counts(prefill, decode)` checks a running cluster's worker counts against the bounds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

log = logging.getLogger(__name__)

RatioMode = Literal["fixed", "adaptive", "advisory"]

REMOVED_SCALING_KEYS = ("allow_scale_out", "allow_scale_in", "scale_in_load", "max_workers")
"""Keys of the removed scale-out/scale-in settings: accepted and ignored, with a warning."""
_warned: set[str] = set()


def _drop_removed_keys(data: Any) -> Any:
    """`data` without `REMOVED_SCALING_KEYS` (each warned about once per process); ValueError
    when one asks for scaling (`allow_scale_out` / `allow_scale_in` true)."""
    if not isinstance(data, dict) or not any(k in data for k in REMOVED_SCALING_KEYS):
        return data
    for key in ("allow_scale_out", "allow_scale_in"):
        if data.get(key) is True:
            raise ValueError(
                f"ratio.{key}=true: the controller no longer adds or removes workers (it only "
                "switches roles; scaling is the launcher's job); remove the key"
            )
    for key in REMOVED_SCALING_KEYS:
        if key in data and key not in _warned:
            _warned.add(key)
            log.warning("ratio.%s is deprecated and ignored (scaling was removed)", key)
    return {k: v for k, v in data.items() if k not in REMOVED_SCALING_KEYS}


class RatioConfig(BaseModel):
    """The ``[ratio]`` section. Defaults: controller off (`mode = "fixed"`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    mode: RatioMode = Field(
        default="fixed",
        description="'fixed': the ratio never changes (controller off); 'adaptive': the "
        "controller switches roles; 'advisory': it decides and logs "
        "what it would do, changing nothing.",
    )
    slo_ttft_ms: float | None = Field(
        default=None, gt=0, description="TTFT SLO in ms (required unless mode is 'fixed')."
    )
    slo_tpot_ms: float | None = Field(
        default=None, gt=0, description="TPOT SLO in ms (required unless mode is 'fixed')."
    )
    attainment_target: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Share of requests that must meet both SLOs (DistServe's goodput target).",
    )
    min_prefill: int = Field(default=1, ge=1, description="Fewest prefill workers.")
    max_prefill: int | None = Field(
        default=None, ge=1, description="Most prefill workers (None: no bound but the cluster)."
    )
    min_decode: int = Field(default=1, ge=1, description="Fewest decode workers.")
    max_decode: int | None = Field(
        default=None, ge=1, description="Most decode workers (None: no bound but the cluster)."
    )
    window_s: float = Field(
        default=10.0, gt=0, description="Observation window: outcomes and samples this recent."
    )
    min_requests: int = Field(
        default=5, ge=1, description="Fewest finished requests in a window to act on it."
    )
    interval_s: float = Field(
        default=2.0,
        gt=0,
        description="Evaluation period; at most one change (a role switch or, in a hybrid "
        "cluster, a threshold move) is started per interval.",
    )
    cooldown_s: float = Field(
        default=10.0,
        ge=0,
        description="No change starts within this long after the previous change completed.",
    )
    hysteresis: float = Field(
        default=0.05,
        ge=0,
        lt=0.5,
        description="Dead band in attainment points: act below target - hysteresis; a phase is "
        "'the' bottleneck only when its miss rate exceeds the other's by more than this.",
    )
    evidence_z: float = Field(
        default=1.0,
        ge=0,
        description="Act only when the upper end of the Wilson interval (this many standard "
        "errors) of the window's attainment is below target - hysteresis (0: point estimate).",
    )
    revert_worse: bool = Field(
        default=True,
        description="Switch a worker back when its switch lowered attainment by more than "
        "hysteresis (judged on the first min_requests requests after it), and bar that "
        "direction for tabu_s; a hybrid threshold move likewise (a raise judged by TPOT, a "
        "lower by TTFT attainment).",
    )
    tabu_s: float = Field(
        default=60.0, ge=0, description="How long a reverted direction is not tried again."
    )
    kv_high: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="Decode KV utilisation at or above which decode counts as saturated.",
    )
    backlog: float = Field(
        default=2.0,
        gt=0,
        description="Mean requests waiting per worker of a role at or above which that role "
        "counts as queued: a queue says which role the requests wait for (TTFT misses with no "
        "prefill queue wait for decode capacity; decode KV held by requests queued for prefill "
        "is not a decode shortage).",
    )
    max_step: int = Field(
        default=4,
        ge=1,
        description="Most workers one decision moves: a switch toward the role the previous "
        "switch fed, made as soon as the cooldown allowed, doubles the step (1, 2, 4, ..) up to "
        "this and to half the donor role.",
    )
    drain_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="SetRole drain limit: in-flight work left after it is aborted (UNAVAILABLE).",
    )
    sample_interval_s: float = Field(
        default=0.5, gt=0, description="Period of worker-load samples (from the pool's views)."
    )
    decisions_path: Path | None = Field(
        default=None,
        description="JSONL file every decision record is appended to (None: memory and log).",
    )
    record_holds: bool = Field(
        default=True,
        description="Record 'hold' evaluations too (off: only changes and their results).",
    )

    @model_validator(mode="before")
    @classmethod
    def _removed(cls, data: Any) -> Any:
        return _drop_removed_keys(data)

    @model_validator(mode="after")
    def _check(self) -> RatioConfig:
        if self.mode != "fixed" and (self.slo_ttft_ms is None or self.slo_tpot_ms is None):
            raise ValueError(
                f"mode {self.mode!r} needs slo_ttft_ms and slo_tpot_ms, got "
                f"slo_ttft_ms={self.slo_ttft_ms}, slo_tpot_ms={self.slo_tpot_ms}"
            )
        for role in ("prefill", "decode"):
            lo, hi = getattr(self, f"min_{role}"), getattr(self, f"max_{role}")
            if hi is not None and hi < lo:
                raise ValueError(f"max_{role}={hi} is below min_{role}={lo}")
        if self.window_s < self.interval_s:
            raise ValueError(
                f"window_s={self.window_s} must be >= interval_s={self.interval_s} (a window "
                "must cover at least one evaluation period)"
            )
        if self.sample_interval_s > self.interval_s:
            raise ValueError(
                f"sample_interval_s={self.sample_interval_s} must be <= "
                f"interval_s={self.interval_s}"
            )
        if self.attainment_target - self.hysteresis <= 0:
            raise ValueError(
                f"attainment_target - hysteresis must be > 0, got attainment_target="
                f"{self.attainment_target}, hysteresis={self.hysteresis}"
            )
        pinned = self.max_prefill == self.min_prefill and self.max_decode == self.min_decode
        if self.mode != "fixed" and pinned:
            raise ValueError(
                f"mode {self.mode!r} with min_prefill == max_prefill ({self.min_prefill}) and "
                f"min_decode == max_decode ({self.min_decode}) leaves nothing to decide; use "
                "mode 'fixed' or widen the bounds"
            )
        return self

    @property
    def enabled(self) -> bool:
        """True when a controller should run (mode 'adaptive' or 'advisory')."""
        return self.mode != "fixed"

    @property
    def slo_ttft_s(self) -> float:
        """TTFT SLO in seconds (only meaningful when `enabled`)."""
        assert self.slo_ttft_ms is not None, "slo_ttft_ms is unset (mode 'fixed')"
        return self.slo_ttft_ms / 1e3

    @property
    def slo_tpot_s(self) -> float:
        """TPOT SLO in seconds (only meaningful when `enabled`)."""
        assert self.slo_tpot_ms is not None, "slo_tpot_ms is unset (mode 'fixed')"
        return self.slo_tpot_ms / 1e3

    def check_counts(self, prefill: int, decode: int) -> None:
        """ValueError naming the bound when a cluster of `prefill` + `decode` workers starts
        outside the bounds (only when the controller is enabled: 'fixed' checks nothing)."""
        if not self.enabled:
            return
        bounds = {
            "prefill": (prefill, self.min_prefill, self.max_prefill),
            "decode": (decode, self.min_decode, self.max_decode),
        }
        for role, (n, lo, hi) in bounds.items():
            if n < lo or (hi is not None and n > hi):
                raise ValueError(
                    f"the cluster starts with {n} {role} workers, outside ratio.min_{role}={lo}"
                    f" .. ratio.max_{role}={hi}"
                )
