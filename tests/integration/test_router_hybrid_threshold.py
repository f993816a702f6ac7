"""The ratio controller moving the hybrid threshold in a running router, over fake workers.

Every test runs router, fake workers and client on one event loop, with sub-second controller
intervals. Outcomes are fed to the controller (`RatioController.observe`) to script the window;
the request path's own decision (`prefill_path` in the final message) shows which threshold
the router used. Waits are on records and states, never on elapsed time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from router.hybrid import HybridConfig
from router.ratio.config import RatioConfig
from router.ratio.driver import DecisionRecord, RatioController
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.integration.test_router_hybrid import final, req

FAST: dict[str, Any] = dict(
    min_requests=3,
    window_s=5,
    interval_s=0.2,
    sample_interval_s=0.05,
    cooldown_s=0,
    drain_timeout_s=2,
    slo_ttft_ms=1000,
    slo_tpot_ms=50,
)
# 30-token prompts (`req`) go local at 64 and through the prefill worker at 16
HYBRID = HybridConfig(
    local_prefill_max_tokens=64,
    min_local_prefill_max_tokens=16,
    max_local_prefill_max_tokens=128,
    threshold_step=4.0,
)


def ratio_of(c: FakeCluster) -> RatioController:
    assert c.router.ratio is not None, "the router runs no ratio controller"
    return c.router.ratio


def moves(c: FakeCluster, event: str = "decision") -> list[DecisionRecord]:
    return [r for r in ratio_of(c).records if r.event == event and r.action == "threshold"]


def gauge(c: FakeCluster) -> float | None:
    labels = {"model_name": c.router.config.served_model_name}
    return c.router.metrics.registry.get_sample_value(
        "pdserve:hybrid_local_prefill_max_tokens", labels
    )


def feed_tpot_misses(c: FakeCluster, n: int = 6) -> None:
    """`n` local-path requests that met TTFT and missed TPOT: decode is the bottleneck, and
    local prefills ran in its batches."""
    for _ in range(n):
        ratio_of(c).observe(ttft_s=0.01, tpot_s=0.5, ok=True, e2e_s=1.0, path="local")


def test_adaptive_lowers_the_threshold_and_the_next_request_uses_it(tiny_model_dir: Path) -> None:
    ratio = RatioConfig(mode="adaptive", **FAST)

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, hybrid=HYBRID, ratio=ratio) as c:
            p, d = c.prefill[0], c.decode[0]
            first = final(await c.generate(req("before")))  # 30 <= 64: local
            assert (first.prefill_path, first.prefill_path_reason) == ("local", "short_prompt")
            assert gauge(c) == 64
            feed_tpot_misses(c)
            await wait_until(lambda: bool(moves(c, "done")), 5.0, "a threshold move done")
            rec = moves(c)[0]
            assert (rec.mode, rec.applied, rec.threshold_from, rec.threshold_to) == (
                "adaptive",
                True,
                64,
                16,
            )
            assert "lower local_prefill_max_tokens 64 -> 16" in rec.reason
            assert moves(c, "done")[0].decision_seq == rec.seq
            assert c.router.service.lifecycle.threshold is ratio_of(c).threshold
            assert gauge(c) == 16
            after = final(await c.generate(req("after")))  # 30 > 16: through P now
            assert (after.prefill_path, after.prefill_path_reason) == ("remote", "long_prompt")
            assert p.calls["Prefill"] == 1 and d.calls["Generate"] == 1
            assert all(w.calls["SetRole"] == 0 for w in c.workers)  # no role changed
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_advisory_records_a_threshold_move_and_keeps_the_threshold(tiny_model_dir: Path) -> None:
    ratio = RatioConfig(mode="advisory", **FAST)

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, hybrid=HYBRID, ratio=ratio) as c:
            feed_tpot_misses(c)
            await wait_until(lambda: bool(moves(c)), 5.0, "an advised threshold move")
            rec = moves(c)[0]
            assert (rec.applied, rec.threshold_from, rec.threshold_to) == (False, 64, 16)
            assert not moves(c, "done")
            assert gauge(c) == 64 and rec.local_prefill_max_tokens == 64
            got = final(await c.generate(req("still-local")))
            assert (got.prefill_path, got.prefill_path_reason) == ("local", "short_prompt")
            await c.assert_no_leaks()

    asyncio.run(scenario())
