"""What the GPU readiness steps share: the step context, the report record of one step, the
random models they make, and the greedy-comparison rule. Runs in each step's subprocess.

A step never raises for a failed check: it records the check (`StepReport.check`) and goes
on, so one wrong kernel does not hide the others. An exception that escapes a step is the
step's failure (the orchestrator records it with its traceback).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

TIE_TOL = 1e-4  # float32: top-2 logits this close are a near-tie (tests/integration, HF)
BF16_TIE_REL = 2**-5  # bfloat16: gap within this fraction of the top logit is a near-tie


@dataclass(frozen=True)
class Ctx:
    """One step's context. `dry_run`: CPU, small sizes, the GPU-only parts skipped with a
    reason. `work`: scratch folder (models, inputs; never the report folder)."""

    dry_run: bool
    work: Path

    @property
    def device(self) -> torch.device:
        return torch.device("cpu" if self.dry_run else "cuda")


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""
    max_diff: float | None = None


@dataclass
class StepReport:
    """What one step found: checks (pass/fail each), metrics (numbers), notes, skipped parts."""

    checks: list[Check] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def check(self, name: str, ok: bool, detail: str = "", max_diff: float | None = None) -> bool:
        self.checks.append(Check(name, bool(ok), detail, max_diff))
        mark = "ok  " if ok else "FAIL"
        diff = "" if max_diff is None else f" max_diff={max_diff:.3e}"
        print(f"  [{mark}] {name}{diff} {detail}", flush=True)
        return bool(ok)

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"  note: {text}", flush=True)

    def skip(self, what: str, why: str) -> None:
        self.skipped.append(f"{what}: {why}")
        print(f"  skipped {what}: {why}", flush=True)

    def metric(self, key: str, value: Any) -> None:
        self.metrics[key] = value
        print(f"  {key} = {value}", flush=True)

    @property
    def status(self) -> str:
        if any(not c.ok for c in self.checks):
            return "fail"
        return "pass" if self.checks or self.metrics else "skipped"

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "checks": [asdict(c) for c in self.checks],
            "metrics": self.metrics,
            "notes": self.notes,
            "skipped": self.skipped,
        }


def write_json(path: Path, obj: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str) + "\n")
    tmp.replace(path)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Any, device: torch.device, iters: int, warmup: int = 1) -> float:
    """Median seconds of `fn()` over `iters` runs after `warmup` (device synchronized)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def model_dir(ctx: Ctx, preset: str) -> Path:
    """The `preset` random model (float32 checkpoint, seed 0), made once per work folder."""
    from tooling.models.random_model import make_random_model

    out = ctx.work / "models" / preset
    if not (out / "model.safetensors").is_file():
        t0 = time.perf_counter()
        make_random_model(out, preset, seed=0)  # type: ignore[arg-type]
        print(f"  made model {preset} in {time.perf_counter() - t0:.1f}s -> {out}", flush=True)
    return out


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where `a` and `b` differ (a shorter list differs at its end)."""
    for k, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return k
    return None if len(a) == len(b) else min(len(a), len(b))


def greedy_agrees(
    ours: list[int], ref: list[int], ref_logits: list[torch.Tensor], rel: float | None
) -> tuple[bool, str]:
    """Token-for-token equality, or a near-tie at the first difference: the reference's logit
    for our token is within `TIE_TOL` (rel None: float32) or `rel * |top|` (bfloat16) of its
    top logit. Later tokens are not compared (the sequences have diverged)."""
    k = first_difference(ours, ref)
    if k is None:
        return True, "equal"
    if k >= len(ours) or k >= len(ref) or k >= len(ref_logits):
        return False, f"lengths differ at {k}: {len(ours)} vs {len(ref)}"
    row = ref_logits[k].float()
    top = float(row.max())
    gap = top - float(row[ours[k]])
    bound = TIE_TOL if rel is None else rel * abs(top)
    if gap <= bound:
        return True, f"near-tie at token {k} (gap {gap:.3g} <= {bound:.3g})"
    return False, f"differs at token {k}: ours {ours[k]} ref {ref[k]} (gap {gap:.3g} > {bound:.3g})"


def bf16_agrees(
    ours: list[int],
    ref: list[int],
    ref_logits: list[torch.Tensor],
    f32_logits_at: Callable[[int], torch.Tensor],
) -> tuple[bool, str]:
    """Judge bfloat16 greedy tokens `ours` against HF's bfloat16 ones `ref` (logits
        `ref_logits`, one row per step). Equal, or a near-tie by `greedy_agrees` (rule
        `BF16_TIE_REL`), pass as before. Otherwise, at the first difference k, the judge is HF in
        float32: `f32_logits_at(k)` is HF float32's logits of the next token after the shared
        context (prompt + ref[:k]). The measured bfloat16 noise of that step is
        ``noise = max |ref_logits[k] - f32|`` (how far HF's own bfloat16 logits are from float32,
    over the tokens HF's scores do not mask to -inf; masked ones are masked in float32 too),
        and HF bfloat16's own choice sits ``gap_hf`` below the float32 top. Our token agrees when
        its float32 logit is within ``max(noise, gap_hf)`` of the float32 top: no further from
        float32's choice than bfloat16 itself strays on that step. Later tokens are not compared."""
    ok, why = greedy_agrees(ours, ref, ref_logits, BF16_TIE_REL)
    k = first_difference(ours, ref)
    if ok or k is None or k >= len(ours) or k >= len(ref) or k >= len(ref_logits):
        return ok, why
    f32 = f32_logits_at(k).float()
    b16 = ref_logits[k].float()
    if f32.shape != b16.shape:
        return False, f"{why}; HF float32 logits shape {tuple(f32.shape)} != {tuple(b16.shape)}"
    # HF's scores mask some tokens (-inf: EOS under min_new_tokens); mask float32 alike
    finite = torch.isfinite(b16)
    f32 = f32.masked_fill(~finite, float("-inf"))
    noise = float((b16[finite] - f32[finite]).abs().max())
    top = float(f32.max())
    gap_ours = top - float(f32[ours[k]])
    gap_hf = top - float(f32[ref[k]])
    bound = max(noise, gap_hf)
    verdict = "within" if gap_ours <= bound else "beyond"
    return gap_ours <= bound, (
        f"differs at token {k}: ours {ours[k]} HF bf16 {ref[k]}; under HF float32 ours is "
        f"{gap_ours:.3g} below the top, HF bf16's own choice {gap_hf:.3g}; bf16 noise: HF bf16 "
        f"itself off by {noise:.3g} -> {verdict} the noise"
    )
