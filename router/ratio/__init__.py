"""Prefill:decode ratio controller: SLO-driven role switching (router process, torch-free).

- `config.RatioConfig` — the ``[ratio]`` section (mode, SLOs, bounds, window, cooldown, ...);
- `metrics` — request outcomes + worker samples -> `MetricsWindow`;
- `controller.decide` — the pure core: window + state -> `Decision` with its reason;
- `threshold.decide_with_threshold` — the same core that also moves the hybrid threshold;
- `driver.RatioController` — the async loop, `observe(...)` hook and the JSONL decision log;
- `actuator` — the `Actuator` seam (`PoolActuator`: Worker.SetRole);
"""

from router.ratio.actuator import ActuationError, Actuator, PoolActuator
from router.ratio.config import RatioConfig
from router.ratio.controller import ControllerState, Decision, decide
from router.ratio.driver import DecisionRecord, RatioController
from router.ratio.metrics import MetricsAggregator, MetricsWindow

__all__ = [
    "ActuationError",
    "Actuator",
    "ControllerState",
    "Decision",
    "DecisionRecord",
    "MetricsAggregator",
    "MetricsWindow",
    "PoolActuator",
    "RatioConfig",
    "RatioController",
    "decide",
]
