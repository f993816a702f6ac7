"""`python -m benchmarks.gpu_check --dry-run` on the CPU: the GPU readiness kit's plan, imports
and CPU-side parts (model making, the CPU engine and HF references through `pdserve batch`,
Triton in its interpreter, the speed arithmetic, the memfd plane between two processes, a 1P1D
cluster vs the colocated engine) and its report writing, so the kit does not rot between the
rare runs on a lent GPU (docs/gpu.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.gpu_check import STEPS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_dry_run_passes_every_step_and_writes_both_reports(tmp_path: Path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--dry-run",
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=400,
        check=False,
    )
    doc = json.loads((out / "gpu_check.json").read_text())
    steps = {s["name"]: s for s in doc["steps"]}
    assert list(steps) == list(STEPS)
    bad = {
        n: (s["status"], s.get("reason"), [c for c in s.get("checks", []) if not c["ok"]])
        for n, s in steps.items()
        if s["status"] != "pass"
    }
    assert not bad, f"{bad}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0
    assert steps["transfer"]["metrics"]["plane"] == "memfd"
    exported = [c for c in steps["transfer"]["checks"] if c["name"] == "cache exported"]
    assert [(c["ok"], c["detail"]) for c in exported] == [(True, "offer made")]
    assert all(c["ok"] for c in steps["engine"]["checks"]) and len(steps["engine"]["checks"]) == 12
    md = (out / "gpu_check.md").read_text()
    assert "| transfer | **pass** |" in md


def test_a_step_that_times_out_is_recorded_and_the_run_goes_on(tmp_path: Path):
    """A step that hangs (the test-only --hang) is killed at what is left of --budget-s and
    recorded as a timeout; the next step, with no budget left, is skipped; the report is
    still written and the exit code says so."""
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.gpu_check",
            "--dry-run",
            "--only",
            "engine,env",
            "--hang",
            "engine",
            "--budget-s",
            "11",  # the engine step gets it all; under 10 s left, env is skipped
            "--out",
            str(out),
            "--work",
            str(tmp_path / "work"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    doc = json.loads((out / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in doc["steps"]}
    assert statuses["engine"] == "timeout", (statuses, proc.stdout[-2000:])
    assert statuses["env"] == "skipped"
    assert proc.returncode == 1
    assert "| engine | **timeout** |" in (out / "gpu_check.md").read_text()


def test_unknown_step_is_refused():
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--out", "/nonexistent", "--only", "x"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 2 and "unknown steps ['x']" in proc.stderr
