"""Benchmark output stays out of git: every benchmark's `--out` defaults under the git-ignored
`runs/`, and what is tracked as results (the curated summary and its plots) stays small."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS_BUDGET_BYTES = 200_000


def _out_defaults(path: Path) -> list[str]:
    """The `default=` of every `add_argument("--out", ...)` call in a script (None if absent;
    an f-string's leading literal)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"):
            continue
        if not (node.args and isinstance(node.args[0], ast.Constant)):
            continue
        if node.args[0].value != "--out":
            continue
        default = next((k.value for k in node.keywords if k.arg == "default"), None)
        if isinstance(default, ast.JoinedStr):  # f"runs/x-{stamp}": its literal head counts
            head = default.values[0] if default.values else None
            found.append(head.value if isinstance(head, ast.Constant) else None)
            continue
        found.append(ast.literal_eval(default) if default is not None else None)
    return found


def test_every_benchmark_writes_under_runs_by_default() -> None:
    scripts = sorted((ROOT / "benchmarks").glob("bench_*.py"))
    assert scripts
    for script in scripts:
        for default in _out_defaults(script):
            assert isinstance(default, str) and default.startswith("runs/"), (
                f"{script.name}: --out defaults to {default!r}, not a path under runs/"
            )
    assert "/runs/" in (ROOT / ".gitignore").read_text().split()


def test_tracked_results_stay_under_budget() -> None:
    git = shutil.which("git")
    if git is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: nothing tracked to measure")
    listed = subprocess.run(
        [git, "ls-files", "-z", "benchmarks/results", "benchmarks/RESULTS.md"],
        cwd=ROOT, capture_output=True, check=True, timeout=30,
    ).stdout.decode()  # fmt: skip
    files = [ROOT / name for name in listed.split("\0") if name]
    assert ROOT / "benchmarks/RESULTS.md" in files
    total = sum(f.stat().st_size for f in files if f.exists())
    assert total < RESULTS_BUDGET_BYTES, (
        f"tracked results are {total} bytes (budget {RESULTS_BUDGET_BYTES}): keep full runs in "
        "runs/ and only the curated summary in benchmarks/RESULTS.md"
    )
