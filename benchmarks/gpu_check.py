"""GPU readiness check: one prepared run that proves pdserve's GPU path in a few minutes.

    python -m benchmarks.gpu_check --out DIR [--dry-run] [--only STEP,...] [--budget-s N]

Steps (`STEPS`, in order): env (GPU, versions, measured copy GB/s and bf16 TFLOP/s), kernels
(compiled Triton attention vs the torch reference), engine (greedy tokens through
``pdserve batch --device cuda`` vs the CPU float32 engine and HF), speed (prefill MFU and
decode MBU vs HF transformers on a 1B-class random Llama), transfer (CUDA IPC KV hand-off
between two processes on one GPU, and a 1P1D cluster's greedy output vs the colocated engine).

Each step runs in its own subprocess (``--step NAME``) under a timeout, so a CUDA hang or
crash costs that step only; its result (pass / fail / skipped / timeout / crashed, checks with
their max differences, metrics, timings) is added to ``DIR/gpu_check.json`` and
``DIR/gpu_check.md``, rewritten after every step so a killed run still leaves what it found.
``--budget-s`` caps the whole run: a step gets at most its own limit and what is left.

``--dry-run``: the same plan on the CPU, small sizes, the GPU-only parts skipped with a reason
(Triton runs in its interpreter); tested in CI (tests/integration/test_gpu_check_dry_run.py).
How to run it on a lent GPU machine: docs/gpu.md. Runs in the CLI process (the orchestrator)
and in one child process per step; scratch files go to ``--work`` (default: a temp folder).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# name -> (limit on the GPU in seconds, limit in a dry run, what it checks)
STEPS: dict[str, tuple[float, float, str]] = {
    "env": (60, 60, "GPU, driver, versions; measured copy GB/s and bf16 matmul TFLOP/s"),
    "kernels": (120, 120, "Triton attention compiled vs the torch reference"),
    "engine": (150, 120, "pdserve batch on the GPU vs CPU float32 engine and HF (tiny, small)"),
    "speed": (150, 90, "prefill MFU / decode MBU vs HF, 1B-class Llama, batch 1-128"),
    "transfer": (150, 150, "CUDA IPC KV hand-off (GB/s vs memcpy); 1P1D vs colocated"),
}
DEFAULT_BUDGET_S = 420.0


@dataclass
class StepRun:
    name: str
    status: str  # pass | fail | skipped | timeout | crashed | not run
    seconds: float
    result: dict[str, Any]
    reason: str = ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu_check", description=__doc__)
    p.add_argument("--out", required=True, help="report folder (gpu_check.json, gpu_check.md)")
    p.add_argument("--dry-run", action="store_true", help="CPU, small sizes (CI)")
    p.add_argument("--only", default="", help=f"comma-separated steps of {list(STEPS)}")
    p.add_argument(
        "--budget-s",
        type=float,
        default=DEFAULT_BUDGET_S,
        help="wall-clock cap of the whole run (default %(default)s)",
    )
    p.add_argument("--work", help="scratch folder (models, inputs); default: a temp folder")
    p.add_argument("--step", help=argparse.SUPPRESS)  # internal: run one step here
    p.add_argument("--result", help=argparse.SUPPRESS)
    # Tests only: the named step blocks forever (to test the timeout path deterministically).
    p.add_argument("--hang", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.step:
        if args.step == args.hang:
            threading.Event().wait()
        return _run_step(args.step, args.dry_run, Path(args.work), Path(args.result))
    only = [s for s in args.only.split(",") if s]
    unknown = [s for s in only if s not in STEPS]
    if unknown:
        p.error(f"--only: unknown steps {unknown}; steps are {list(STEPS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="pdserve-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    return run_all(out, work, args.dry_run, only or list(STEPS), args.budget_s, args.hang)


def run_all(
    out: Path, work: Path, dry_run: bool, steps: list[str], budget_s: float, hang: str = ""
) -> int:
    """Run `steps` in order, each in a subprocess; write the report after each. Exit code 0
    when no step failed, timed out or crashed."""
    start = time.monotonic()
    header = {
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "dry_run": dry_run,
        "steps_planned": steps,
        "budget_s": budget_s,
        "host": os.uname().nodename,
    }
    runs = [StepRun(s, "not run", 0.0, {}, "not reached") for s in steps]
    _write_reports(out, header, runs)
    for i, name in enumerate(steps):
        limit = float(STEPS[name][1 if dry_run else 0])
        left = budget_s - (time.monotonic() - start)
        if left < 10:
            runs[i] = StepRun(name, "skipped", 0.0, {}, f"budget spent ({budget_s:g}s)")
            _write_reports(out, header, runs)
            continue
        timeout = min(limit, left)
        print(f"== step {name} (limit {timeout:.0f}s): {STEPS[name][2]}", flush=True)
        runs[i] = _spawn(name, dry_run, work, timeout, hang)
        print(
            f"== step {name}: {runs[i].status} in {runs[i].seconds:.1f}s {runs[i].reason}",
            flush=True,
        )
        _write_reports(out, header, runs)
    header["seconds"] = round(time.monotonic() - start, 1)
    _write_reports(out, header, runs)
    print(f"== report: {out / 'gpu_check.md'}", flush=True)
    return 0 if all(r.status in ("pass", "skipped") for r in runs) else 1


def _spawn(name: str, dry_run: bool, work: Path, timeout: float, hang: str = "") -> StepRun:
    result_file = work / f"step-{name}.json"
    result_file.unlink(missing_ok=True)
    argv = [
        sys.executable,
        "-m",
        "benchmarks.gpu_check",
        "--step",
        name,
        "--out",
        str(work),
        "--work",
        str(work),
        "--result",
        str(result_file),
    ]
    if dry_run:
        argv.append("--dry-run")
    if hang:
        argv += ["--hang", hang]
    env = os.environ.copy()
    env["PYTHONUNBUFFERED"] = "1"
    if name == "kernels" and dry_run:
        env["TRITON_INTERPRET"] = "1"  # before triton is imported: the CPU interpreter
    else:
        env.pop("TRITON_INTERPRET", None)
    t0 = time.monotonic()
    # A new session: on a timeout the whole group (workers of a cluster too) is killed.
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        res = _read(result_file)
        return StepRun(name, "timeout", time.monotonic() - t0, res, f"killed after {timeout:.0f}s")
    _kill_group(proc)  # anything the step left behind
    seconds = time.monotonic() - t0
    res = _read(result_file)
    if rc != 0 or not res:
        why = res.get("error", "") if res else "no result written"
        return StepRun(name, "crashed", seconds, res, f"exit code {rc}: {why}"[:2000])
    return StepRun(name, str(res["status"]), seconds, res)


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    import signal

    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _read(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}


def _run_step(name: str, dry_run: bool, work: Path, result: Path) -> int:
    """Child side: run one step; its report (or the exception) goes to `result`."""
    import importlib

    from benchmarks.gpucheck.common import Ctx, write_json

    ctx = Ctx(dry_run=dry_run, work=work)
    try:
        module = importlib.import_module(f"benchmarks.gpucheck.{name}")
        rep = module.run(ctx)
    except BaseException as exc:
        tb = traceback.format_exc()
        print(tb, file=sys.stderr, flush=True)
        write_json(
            result,
            {"status": "crashed", "error": f"{type(exc).__name__}: {exc}", "traceback": tb[-4000:]},
        )
        return 1
    write_json(result, rep.to_json())
    return 0


def _write_reports(out: Path, header: dict[str, Any], runs: list[StepRun]) -> None:
    """Both reports, each replaced whole (a reader never sees half a file). Imports no torch:
    the orchestrator stays light and quick."""
    doc = {
        **header,
        "steps": [
            {
                "name": r.name,
                "status": r.status,
                "seconds": round(r.seconds, 1),
                "reason": r.reason,
                **{k: v for k, v in r.result.items() if k != "status"},
            }
            for r in runs
        ],
    }
    for name, text in (
        ("gpu_check.json", json.dumps(doc, indent=2, default=str) + "\n"),
        ("gpu_check.md", render_markdown(doc)),
    ):
        tmp = out / (name + ".tmp")
        tmp.write_text(text)
        tmp.replace(out / name)


def render_markdown(doc: dict[str, Any]) -> str:
    """The report as Markdown: a summary table, then each step's checks and metrics."""
    kind = "dry run (CPU)" if doc.get("dry_run") else "GPU run"
    lines = [f"# pdserve GPU check — {kind}, {doc.get('started', '')}", ""]
    if "seconds" in doc:
        lines += [f"Total {doc['seconds']} s (budget {doc.get('budget_s')} s).", ""]
    lines += ["| step | status | seconds | checks (ok/all) | reason |", "|---|---|---|---|---|"]
    for s in doc["steps"]:
        checks = s.get("checks", [])
        ok = sum(1 for c in checks if c["ok"])
        lines.append(
            f"| {s['name']} | **{s['status']}** | {s['seconds']} | {ok}/{len(checks)} "
            f"| {s.get('reason', '') or s.get('error', '')} |"
        )
    for s in doc["steps"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        for c in s.get("checks", []):
            diff = "" if c.get("max_diff") is None else f" (max diff {c['max_diff']:.3e})"
            lines.append(f"- {'ok' if c['ok'] else '**FAIL**'} {c['name']}{diff} {c['detail']}")
        for k, v in s.get("metrics", {}).items():
            lines.append(f"- `{k}`: {json.dumps(v, default=str)}")
        lines += [f"- note: {n}" for n in s.get("notes", [])]
        lines += [f"- skipped {x}" for x in s.get("skipped", [])]
        if s.get("error"):
            lines += ["", "```", str(s.get("traceback", s["error"]))[-3000:], "```"]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
