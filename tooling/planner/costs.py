"""Cost model of the planner's simulator: step times of prefill and decode workers, KV transfer
and serving overheads, as fitted coefficients (seconds). Pure (numpy/scipy), no torch; runs in
`pdserve profile` / `pdserve plan` and the benchmarks.

    prefill step  = a + b * tokens + c * attn      attn = sum over chunks of chunk * (start + chunk)
    decode step   = a + b * batch  + c * context   context = sum of the batch's context lengths
    mixed step    = max(decode step, prefill step over chunks + decode rows)   (colocated)
    transfer      = a + b * prompt_tokens          KV still in flight after the prefill compute
    ttft overhead = a + b * prompt_tokens          router, RPCs, sampling, first-token delivery
    token overhead = what a decode step takes beyond the model step (engine loop, sampling,
                     streaming), measured at batch 1 (one token per step): added once per step

CPU that the serving path burns outside the model steps, on other threads (a worker's gRPC
loop, the KV transport) and other processes (router, client): it slows everything sharing the
cores but does not lengthen a step by itself. `prefill_request_s` per request on the prefill
worker plus `prefill_kv_token_cpu_s` per prompt token whose KV it sends, `decode_token_cpu_s`
per token on the decode worker plus `decode_kv_token_cpu_s` per prompt token whose KV it
receives, and on the host's other processes `host_request_s` per request + `host_token_s` per
streamed token. (The KV terms exist because a per-request charge alone, fitted on a chat and a
summarize load, put the summarize prompts' KV push on every chat request: 131 ms of prefill-side
CPU per request where the chat load measured 36.)

A step on several threads meets at a barrier after every parallel operation, so while the
cores are oversubscribed it turns only part of its processor share into progress:
`contended_prefill_eff` for a step whose arithmetic dominates, `contended_decode_eff` otherwise
(`contended_eff`; 1 = processor sharing; fitted to served runs by `fit_contention`).

`attn` is the attention work of a chunked prefill (a chunk of `n` tokens starting at position
`s` attends over `s + n` positions); for one whole prompt of `n` tokens it is `n**2`.

Coefficients come from measurements only: `fit_linear` (non-negative least squares) over the
samples `profiler.profile_engine` takes on this machine, `calibrate_overheads` (a robust line,
`fit_robust_line`) over the records of a real low-load run, and `fit_cpu_overheads` over
per-process CPU time of real loaded runs. A `CostModel` keeps its samples and fit errors for
the report.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from scipy.optimize import nnls


@dataclass(frozen=True)
class Linear:
    """y = coef[0] + coef[1] * x1 + coef[2] * x2 (missing terms are 0)."""

    coef: tuple[float, ...]
    rel_err_p50: float = 0.0  # median |fit - sample| / sample over the fitting samples
    rel_err_max: float = 0.0

    def __call__(self, *x: float) -> float:
        return self.coef[0] + sum(c * v for c, v in zip(self.coef[1:], x, strict=False))


def fit_linear(xs: Sequence[tuple[float, ...]], ys: Sequence[float]) -> Linear:
    """Non-negative least squares of y on [1, x...], weighted by 1/y so that small steps
    count as much as large ones (relative error). ValueError for fewer samples than terms."""
    if not xs or len(xs) != len(ys):
        raise ValueError(f"need matching, non-empty samples, got {len(xs)} xs and {len(ys)} ys")
    a = np.array([(1.0, *x) for x in xs], dtype=float)
    y = np.array(ys, dtype=float)
    if len(y) < a.shape[1]:
        raise ValueError(f"need at least {a.shape[1]} samples, got {len(y)}")
    w = 1.0 / np.maximum(y, 1e-9)
    coef, _ = nnls(a * w[:, None], y * w)
    fit = a @ coef
    rel = np.abs(fit - y) / np.maximum(y, 1e-9)
    return Linear(tuple(float(c) for c in coef), float(np.median(rel)), float(rel.max()))


@dataclass(frozen=True)
class CostModel:
    """Everything the simulator charges for, plus where the numbers came from."""

    prefill: Linear  # (tokens, attn) -> s
    decode: Linear  # (batch, context) -> s
    transfer: Linear = Linear((0.0, 0.0))  # (prompt tokens) -> s
    ttft_overhead: Linear = Linear((0.0, 0.0))  # (prompt tokens) -> s
    token_overhead_s: float = 0.0
    prefill_request_s: float = 0.0
    prefill_kv_token_cpu_s: float = 0.0
    decode_token_cpu_s: float = 0.0
    decode_kv_token_cpu_s: float = 0.0
    host_request_s: float = 0.0
    host_token_s: float = 0.0
    # Share of its processor time a multi-thread step turns into progress while the cores are
    # oversubscribed (1: processor sharing; fitted to served runs by `fit_contention`; which
    # one a step takes: `contended_eff`).
    contended_prefill_eff: float = 1.0
    contended_decode_eff: float = 1.0
    meta: dict[str, Any] = field(default_factory=dict)  # model, threads, machine, samples

    def prefill_s(self, chunks: list[tuple[int, int]]) -> float:
        """One prefill step over `chunks` = [(start, n_tokens), ...]."""
        tokens = sum(n for _, n in chunks)
        attn = sum(n * (s + n) for s, n in chunks)
        return self.prefill(tokens, attn)

    def decode_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests holding `context` tokens in all.

        `token_overhead_s` is added once per step, not per request of the batch: it is
        calibrated at batch 1, where it cannot be told apart from a per-step cost, and
        scaling it by the batch charged e.g. +80 ms to a 16-request step for a 5 ms overhead."""
        return self.decode(batch, context) + self.token_overhead_s

    def mixed_s(self, chunks: list[tuple[int, int]], batch: int, context: int) -> float:
        """One colocated step: prompt `chunks` plus `batch` decode rows holding `context`
        tokens. No chunks: a decode step. Otherwise the larger of the decode step and one
        prefill step whose rows include the decode rows (a decode row of context c is a
        one-token chunk at position c - 1): a step is as slow as its weights' reads
        (decode-bound) or its arithmetic (prefill-bound), whichever dominates."""
        if not chunks:
            return self.decode_s(batch, context)
        tokens = sum(n for _, n in chunks) + batch
        attn = sum(n * (s + n) for s, n in chunks) + context
        step = self.prefill(tokens, attn)
        if batch:
            step = max(step, self.decode(batch, context)) + self.token_overhead_s
        return step

    def step_s(self, chunks: list[tuple[int, int]], batch: int, context: int) -> float:
        """One engine step of any worker, from its composition (what the simulator's real
        scheduler scheduled): prompt `chunks` only is a prefill step (`prefill_s`); decode
        rows, alone or with chunks, a `mixed_s` step."""
        if not batch:
            return self.prefill_s(chunks)
        return self.mixed_s(chunks, batch, context)

    def contended_eff(self, chunks: list[tuple[int, int]], batch: int, context: int) -> float:
        """The efficiency under contention of a step of this composition: the prefill one
        when its arithmetic dominates (as `mixed_s` decides: a prompt-only step, or one whose
        prefill part outweighs its decode part), the decode one otherwise."""
        if not chunks:
            return self.contended_decode_eff
        if not batch:
            return self.contended_prefill_eff
        tokens = sum(n for _, n in chunks) + batch
        attn = sum(n * (s + n) for s, n in chunks) + context
        if self.prefill(tokens, attn) > self.decode(batch, context):
            return self.contended_prefill_eff
        return self.contended_decode_eff

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> CostModel:
        def lin(key: str) -> Linear:
            return Linear(
                tuple(data[key]["coef"]), data[key]["rel_err_p50"], data[key]["rel_err_max"]
            )

        def num(key: str) -> float:
            return float(data.get(key, 0.0))

        return cls(
            prefill=lin("prefill"),
            decode=lin("decode"),
            transfer=lin("transfer"),
            ttft_overhead=lin("ttft_overhead"),
            token_overhead_s=num("token_overhead_s"),
            prefill_request_s=num("prefill_request_s"),
            prefill_kv_token_cpu_s=num("prefill_kv_token_cpu_s"),
            decode_token_cpu_s=num("decode_token_cpu_s"),
            decode_kv_token_cpu_s=num("decode_kv_token_cpu_s"),
            host_request_s=num("host_request_s"),
            host_token_s=num("host_token_s"),
            contended_prefill_eff=float(data.get("contended_prefill_eff", 1.0)),
            contended_decode_eff=float(data.get("contended_decode_eff", 1.0)),
            meta=data.get("meta", {}),
        )

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return p

    @classmethod
    def load(cls, path: str | Path) -> CostModel:
        return cls.from_json(json.loads(Path(path).read_text()))

    def summary(self) -> str:
        """One line per term, in ms, for CLI output."""
        p, d, t, o = (
            self.prefill.coef,
            self.decode.coef,
            self.transfer.coef,
            self.ttft_overhead.coef,
        )
        return "\n".join(
            [
                f"prefill step  = {p[0] * 1e3:.3f} ms + {p[1] * 1e6:.3f} us/token + "
                f"{p[2] * 1e9:.3f} ns/token^2   (fit error p50 {self.prefill.rel_err_p50:.1%})",
                f"decode step   = {d[0] * 1e3:.3f} ms + {d[1] * 1e6:.3f} us/request + "
                f"{d[2] * 1e9:.3f} ns/context token   (fit error p50 "
                f"{self.decode.rel_err_p50:.1%})",
                f"transfer      = {t[0] * 1e3:.3f} ms + {t[1] * 1e6:.3f} us/prompt token",
                f"ttft overhead = {o[0] * 1e3:.3f} ms + {o[1] * 1e6:.3f} us/prompt token; "
                f"token overhead {self.token_overhead_s * 1e3:.3f} ms",
                f"cpu beside the steps: prefill {self.prefill_request_s * 1e3:.3f} ms/request + "
                f"{self.prefill_kv_token_cpu_s * 1e6:.1f} us/KV token sent; decode "
                f"{self.decode_token_cpu_s * 1e3:.3f} ms/token + "
                f"{self.decode_kv_token_cpu_s * 1e6:.1f} us/KV token received; host "
                f"{self.host_request_s * 1e3:.3f} ms/request + "
                f"{self.host_token_s * 1e3:.3f} ms/token",
                f"contended efficiency: prefill {self.contended_prefill_eff:.2f}, decode "
                f"{self.contended_decode_eff:.2f}",
            ]
        )


def fit_robust_line(x: Sequence[float], y: Sequence[float]) -> Linear:
    """y = a + b * x with a, b >= 0, robust to outliers (Theil-Sen): b is the median slope
    between the medians of every two distinct x, a the median of y - b * x.

    For residuals such as serving overheads, which are small, noisy and can come out near 0:
    `fit_linear`'s 1/y weighting lets one near-0 sample pull the whole line to 0 (a disagg
    calibration with overheads of 49, 50, 49, 123, 6, 113, 30, 52, 50 ms fitted 2..27 ms)."""
    if not x or len(x) != len(y):
        raise ValueError(f"need matching, non-empty samples, got {len(x)} xs and {len(y)} ys")
    groups: dict[float, list[float]] = {}
    for xi, yi in zip(x, y, strict=True):
        groups.setdefault(float(xi), []).append(float(yi))
    pts = sorted((k, float(np.median(v))) for k, v in groups.items())
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in itertools.combinations(pts, 2)]
    b = max(0.0, float(np.median(slopes))) if slopes else 0.0
    a = max(0.0, float(np.median([yi - b * xi for xi, yi in zip(x, y, strict=True)])))
    ys = np.asarray(y, dtype=float)
    rel = np.abs(a + b * np.asarray(x, dtype=float) - ys) / np.maximum(ys, 1e-9)
    return Linear((a, b), float(np.median(rel)), float(rel.max()))


def calibrate_overheads(
    cost: CostModel, samples: list[tuple[int, float, float | None]]
) -> CostModel:
    """Fit the serving overheads from a real run with nothing queued (one request at a time).

    `samples` = [(prompt tokens, client TTFT s, client TPOT s or None), ...]. The TTFT
    overhead is a robust line (`fit_robust_line`) through what TTFT has beyond one
    whole-prompt prefill step (transfer included: the transfer term is set to 0 and folded in
    here, since the client cannot tell them apart);
    the token overhead is the median of what TPOT has beyond a batch-1 decode step.
    """
    if not samples:
        raise ValueError("calibrate_overheads needs at least one sample")
    xs: list[tuple[float, ...]] = []
    ys: list[float] = []
    extra_tok = []
    for n, ttft, tpot in samples:
        xs.append((float(n),))
        ys.append(max(1e-6, ttft - cost.prefill_s([(0, n)])))
        if tpot is not None:
            extra_tok.append(tpot - cost.decode(1, n))
    over = fit_robust_line([x[0] for x in xs], ys)
    tok = max(0.0, float(np.median(extra_tok))) if extra_tok else 0.0
    meta = {**cost.meta, "calibration_samples": len(samples)}
    return replace(
        cost, transfer=Linear((0.0, 0.0)), ttft_overhead=over, token_overhead_s=tok, meta=meta
    )


@dataclass(frozen=True)
class CpuSample:
    """One loaded run: requests, generated tokens, the CPU seconds the simulator's model steps
    take on each role for it (`sim.charged`: step time x threads; CPU overheads off), the
    CPU seconds measured per role, and the prompt tokens whose KV moved from P to D."""

    requests: int
    tokens: int  # generated, first tokens included
    prefill_steps_s: float
    decode_steps_s: float
    prefill_cpu_s: float
    decode_cpu_s: float
    host_cpu_s: float  # router + client
    kv_prompt_tokens: int = 0  # 0: nothing moved (a colocated worker)


def _rates(units: Sequence[Sequence[float]], spent: Sequence[float]) -> tuple[float, float]:
    """Non-negative CPU seconds per unit of each of two kinds of work (`units`: one row per
    run) that best explain `spent` (least squares). When the runs cannot tell the two apart
    (one run, or proportional work), all of it goes to the first kind."""
    a = np.array(units, dtype=float)
    y = np.array(spent, dtype=float)
    if len(y) >= 2 and np.linalg.matrix_rank(a) == 2:
        first, second = (float(x) for x in nnls(a, y)[0])
        return first, second
    return max(0.0, float(y.sum() / max(a[:, 0].sum(), 1e-9))), 0.0


def fit_cpu_overheads(cost: CostModel, runs: Sequence[CpuSample]) -> CostModel:
    """CPU beside the model steps, per unit of work, from loaded runs (>= 1; two runs with
    different tokens and prompt tokens per request, e.g. a chat and a summarize load, separate
    each role's two parts): prefill per request + per KV token sent, decode per generated token
    + per KV token received, host per request + per token (all non-negative). `*_steps_s`
    must be the step CPU seconds the simulator charges with `cost` (`sim.charged`)."""
    if not runs:
        raise ValueError("fit_cpu_overheads needs at least one run")
    pre, pre_kv = _rates(
        [(r.requests, r.kv_prompt_tokens) for r in runs],
        [r.prefill_cpu_s - r.prefill_steps_s for r in runs],
    )
    tok, dec_kv = _rates(
        [(max(1, r.tokens - r.requests), r.kv_prompt_tokens) for r in runs],
        [r.decode_cpu_s - r.decode_steps_s for r in runs],
    )
    host_tok, host_req = _rates(
        [(r.tokens, r.requests) for r in runs], [r.host_cpu_s for r in runs]
    )
    meta = {**cost.meta, "cpu_runs": [asdict(r) for r in runs]}
    return replace(
        cost,
        prefill_request_s=pre,
        prefill_kv_token_cpu_s=pre_kv,
        decode_token_cpu_s=tok,
        decode_kv_token_cpu_s=dec_kv,
        host_request_s=host_req,
        host_token_s=host_tok,
        meta=meta,
    )
