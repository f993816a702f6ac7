"""RatioConfig validation: defaults, TOML round trip, and every invalid combination fails with
a message naming its fields. Pure, runs in the pytest process."""

from __future__ import annotations

import tomllib
from typing import Any

import pytest
from pydantic import ValidationError

from router.ratio.config import RatioConfig

SLOS = {"slo_ttft_ms": 1000.0, "slo_tpot_ms": 50.0}


def test_default_is_fixed_and_off() -> None:
    c = RatioConfig()
    assert c.mode == "fixed" and not c.enabled
    c.check_counts(7, 0)  # 'fixed' checks nothing


def test_toml_section_validates() -> None:
    text = """
    [ratio]
    mode = "adaptive"
    slo_ttft_ms = 2000
    slo_tpot_ms = 100
    min_prefill = 1
    max_prefill = 3
    min_decode = 1
    max_decode = 3
    window_s = 10
    interval_s = 2
    cooldown_s = 10
    hysteresis = 0.05
    """
    c = RatioConfig.model_validate(tomllib.loads(text)["ratio"])
    assert c.enabled and c.slo_ttft_s == 2.0 and c.slo_tpot_s == 0.1
    assert c.max_prefill == 3 and c.cooldown_s == 10
    with pytest.raises(ValidationError):
        c.mode = "fixed"  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"mode": "adaptive"}, ["slo_ttft_ms", "slo_tpot_ms"]),
        ({"mode": "advisory", "slo_ttft_ms": 100.0}, ["slo_tpot_ms"]),
        ({"allow_scale_out": True}, ["allow_scale_out", "switches roles"]),
        ({**SLOS, "mode": "adaptive", "min_prefill": 3, "max_prefill": 2}, ["max_prefill"]),
        ({**SLOS, "mode": "adaptive", "min_decode": 2, "max_decode": 1}, ["max_decode"]),
        ({**SLOS, "mode": "adaptive", "window_s": 1, "interval_s": 2}, ["window_s", "interval_s"]),
        ({**SLOS, "mode": "adaptive", "sample_interval_s": 3}, ["sample_interval_s"]),
        (
            {**SLOS, "mode": "adaptive", "attainment_target": 0.1, "hysteresis": 0.2},
            ["attainment_target", "hysteresis"],
        ),
        (
            {**SLOS, "mode": "adaptive", "max_prefill": 1, "max_decode": 1},
            ["min_prefill", "max_decode", "fixed"],
        ),
        ({"mode": "sometimes"}, ["mode"]),
        ({"hysteresis": 0.6}, ["hysteresis"]),
        ({"attainment_target": 1.5}, ["attainment_target"]),
        ({"nonsense": 1}, ["nonsense"]),
    ],
)
def test_invalid_combinations_name_their_fields(fields: dict[str, Any], named: list[str]) -> None:
    with pytest.raises(ValidationError) as info:
        RatioConfig(**fields)
    msg = str(info.value)
    for name in named:
        assert name in msg, msg


def test_check_counts_names_the_bound() -> None:
    c = RatioConfig(**SLOS, mode="adaptive", max_prefill=2, max_decode=3)
    c.check_counts(2, 2)
    with pytest.raises(ValueError, match=r"ratio\.max_prefill=2"):
        c.check_counts(3, 1)
    with pytest.raises(ValueError, match=r"ratio\.min_decode=1"):
        c.check_counts(2, 0)


def test_removed_scaling_keys_load_with_one_warning_each(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`allow_scale_out/in = false`, `scale_in_load` and `max_workers` (the scaling that was
    removed) still load, ignored, warned about once per process; asking for scaling fails."""
    import router.ratio.config as ratio_config

    monkeypatch.setattr(ratio_config, "_warned", set())
    old = {"allow_scale_out": False, "allow_scale_in": False, "scale_in_load": 0.5}
    with caplog.at_level("WARNING", logger="router.ratio.config"):
        c = RatioConfig(**SLOS, mode="adaptive", max_workers=4, **old)
        again = RatioConfig(**SLOS, mode="adaptive", max_workers=4, **old)
    assert c == again == RatioConfig(**SLOS, mode="adaptive")
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 4 and all("deprecated and ignored" in m for m in warned), warned
    with pytest.raises(ValidationError, match="allow_scale_in=true"):
        RatioConfig(**SLOS, mode="adaptive", allow_scale_in=True)


def test_ratio_package_never_imports_torch() -> None:
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys\n"
        "import router.ratio, router.ratio.actuator, router.ratio.config, router.ratio.controller\n"
        "import router.ratio.driver, tests.fakes.ratio_pool, router.ratio.metrics\n"
        "bad = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))\n"
        "assert not bad, bad\n"
        "print('ok')\n"
    )
    repo = Path(__file__).resolve().parents[2]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=repo, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
