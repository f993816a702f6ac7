"""The `[ratio]` section from cluster TOML to the router: validation against the topology (errors
name their fields), the example file through `pdserve up`'s parser, the router's own config
checks, the `python -m router --ratio-json` round trip, and the TTFT/TPOT the router reports.

Pure and fast: no processes, no network.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from pydantic import ValidationError

from deploy.cli import build_parser, up_overrides
from deploy.config import ClusterConfig, load_cluster_config
from deploy.launcher import router_document, write_document
from router.__main__ import parse_args
from router.config import RouterConfig
from router.flow import RequestRun, RunTimings
from router.lifecycle import request_outcome
from router.ratio.config import RatioConfig

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "examples" / "disagg-ratio.toml"
ON: dict[str, Any] = {"mode": "adaptive", "slo_ttft_ms": 500, "slo_tpot_ms": 50}


def cluster(workers: dict[str, int] | None = None, **ratio: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"model": "m", "ratio": {**ON, **ratio}}
    if workers is not None:
        data["workers"] = workers
    return data


def test_default_is_fixed_and_reaches_the_router_config() -> None:
    c = ClusterConfig.model_validate({"model": "m"})
    assert c.ratio == RatioConfig() and c.ratio.mode == "fixed"
    rc = c.router_config({"prefill": ["h:1"], "decode": ["h:2"]})
    assert rc.ratio.mode == "fixed"
    on = ClusterConfig.model_validate(cluster({"prefill": 1, "decode": 2}, max_prefill=2))
    rc = on.router_config({"prefill": ["h:1"], "decode": ["h:2", "h:3"]})
    assert rc.ratio == on.ratio and rc.ratio.mode == "adaptive"


@pytest.mark.parametrize(
    ("data", "names"),
    [
        (cluster({"prefill": 3, "decode": 1}, max_prefill=2), ["ratio.max_prefill", "workers"]),
        (cluster({"prefill": 1, "decode": 1}, min_decode=2), ["ratio.min_decode", "workers"]),
        (cluster({"prefill": 1, "decode": 3}, max_decode=2), ["ratio.max_decode", "workers"]),
        (cluster(min_prefill=3, max_prefill=2), ["ratio", "max_prefill", "min_prefill"]),
        (cluster(min_prefill=0), ["ratio.min_prefill"]),
        (cluster(slo_tpot_ms=None), ["ratio", "slo_tpot_ms"]),
        (cluster(mode="sometimes"), ["ratio.mode"]),
        (cluster(window_s=1, interval_s=2), ["ratio", "window_s", "interval_s"]),
        (cluster(typo=1), ["ratio.typo"]),
        (cluster(allow_scale_out=True), ["ratio.allow_scale_out"]),
        (
            {"model": "m", "mode": "colocated", "ratio": {**ON, "mode": "advisory"}},
            ["ratio.mode", "disagg"],
        ),
    ],
)
def test_bad_ratio_sections_name_their_fields(data: dict[str, Any], names: list[str]) -> None:
    with pytest.raises(ValidationError) as info:
        ClusterConfig.model_validate(data)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in:\n{message}"


def test_fixed_mode_checks_no_bounds() -> None:
    c = ClusterConfig.model_validate(
        {"model": "m", "workers": {"prefill": 3, "decode": 1}, "ratio": {"max_prefill": 2}}
    )
    assert not c.ratio.enabled


def test_example_parses_through_pdserve_up() -> None:
    args = build_parser().parse_args(["up", "--config", str(EXAMPLE)])
    c = load_cluster_config(args.config, up_overrides(args))
    assert (c.ratio.mode, c.workers.prefill, c.workers.decode) == ("adaptive", 1, 2)
    assert c.ratio.decisions_path == Path("ratio-decisions.jsonl")
    rc = c.router_config({"prefill": ["h:1"], "decode": ["h:2", "h:3"]})
    assert rc.ratio == c.ratio
    # A flag that moves the counts outside the bounds is refused, naming both.
    args = build_parser().parse_args(["up", "--config", str(EXAMPLE), "--prefill", "3"])
    with pytest.raises(ValidationError, match=r"ratio\.max_prefill=2.*workers\.prefill=3"):
        load_cluster_config(args.config, up_overrides(args))


def test_router_config_checks_the_ratio_against_its_workers(tmp_path: Path) -> None:
    base: dict[str, Any] = {
        "model_dir": tmp_path,
        "prefill_addrs": ("h:1",),
        "decode_addrs": ("h:2", "h:3"),
    }
    ok = RouterConfig(**base, ratio=RatioConfig(**ON))
    assert ok.ratio.enabled
    with pytest.raises(ValidationError, match=r"ratio\.max_decode=1"):
        RouterConfig(**base, ratio=RatioConfig(**ON, max_decode=1))
    with pytest.raises(ValidationError, match="needs mode 'disagg'"):
        RouterConfig(
            model_dir=tmp_path, mode="colocated", colocated_addrs=("h:1",), ratio=RatioConfig(**ON)
        )


def test_router_document_carries_the_ratio(tmp_path: Path) -> None:
    ratio = RatioConfig(**ON, max_prefill=2, decisions_path=Path("d.jsonl"))
    rc = RouterConfig(
        model_dir=tmp_path, prefill_addrs=("h:1",), decode_addrs=("h:2",), ratio=ratio
    )
    doc = write_document(tmp_path, "router-0", router_document(rc))
    parsed = parse_args(["--config", str(doc)])
    assert parsed.ratio == ratio.model_copy(update={"decisions_path": Path("d.jsonl").resolve()})
    assert parse_args(["--model", str(tmp_path), "--prefill-addr", "h:1", "--decode-addr", "h:2"])
    with pytest.raises(SystemExit):
        parse_args(
            ["--model", "m", "--prefill-addr", "h:1", "--decode-addr", "h:2"]
            + ["--ratio-json", '{"mode": "adaptive"}']
        )  # no SLOs


def _run(ttft_ms: float, tokens: int) -> RequestRun:
    return cast(
        RequestRun, SimpleNamespace(timings=RunTimings(ttft_ms=ttft_ms), completion_tokens=tokens)
    )


def test_request_outcome_ttft_and_tpot() -> None:
    assert request_outcome(_run(0.0, 0), 0.5) == (None, None)  # nothing was sent
    assert request_outcome(_run(100.0, 1), 0.1) == (0.1, None)  # one token: no TPOT
    ttft, tpot = request_outcome(_run(100.0, 5), 0.5)
    assert ttft == pytest.approx(0.1) and tpot == pytest.approx(0.1)  # 0.4 s / 4 tokens
