"""Unloaded latency of a cluster, measured at the start of a run. Orchestrator process.

SLOs can be given relative to the model's unloaded prefill and decode step time, so that one
command means the same on a laptop CPU and on a GPU. `calibrate` measures both through the
public API on an idle cluster: after one discarded warm-up request it sends `repeats` requests
one at a time (each waits for the previous to end), each with `prompt_len` prompt tokens and
`output_len` output tokens, and takes the medians (robust to one disturbed sample either
way; on a machine shared with other work they track the speed the runs will actually get,
where a best-of-N would describe an idle moment):

- `prefill_ms` = client TTFT (router + prefill + transfer + first token, nothing queued);
- `decode_ms` = client TPOT (one decode step per token at batch size 1).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from tooling.goodput.loadgen import LoadJob, run_load
from tooling.goodput.records import RequestSpec


@dataclass(frozen=True)
class Calibration:
    """Unloaded median times and every sample (ms), and what was sent to get them."""

    config: str
    prompt_len: int
    output_len: int
    prefill_ms: float
    decode_ms: float
    ttft_samples: tuple[float, ...]
    tpot_samples: tuple[float, ...]

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def sequential(
    address: str,
    prompt_len: int,
    output_len: int,
    n: int,
    token_seed: int,
    label: str,
    **target: Any,
) -> list[tuple[float, float]]:
    """(TTFT ms, TPOT ms) of `n` requests sent one after another; `target` adds `LoadJob` fields
    (`api`, `model`, `vocab_size` for an OpenAI server). RuntimeError names the status of a
    failed request."""
    out = []
    for i in range(n):
        job = LoadJob(
            address=address,
            specs=[RequestSpec(0, 0.0, prompt_len, output_len)],
            token_seed=token_seed + i,
            label=f"{label}-{i}",
            channels=1,
            timeout_s=600.0,
            **target,
        )
        (rec,) = (await run_load(job, progress=False)).records
        if not rec.ok or rec.ttft_ms is None:
            raise RuntimeError(f"calibration request to {address} failed: {rec.status} {rec.error}")
        out.append((rec.ttft_ms, rec.tpot_ms or 0.0))
    return out


async def calibrate(
    config: str,
    address: str,
    prompt_len: int,
    output_len: int,
    repeats: int = 3,
    token_seed: int = 10**6,
    **target: Any,
) -> Calibration:
    """Measure unloaded prefill (TTFT) and decode step (TPOT) times (see module docstring);
    `target` as in `sequential`."""
    if output_len < 2:
        raise ValueError(f"output_len must be >= 2 to measure a decode step, got {output_len}")
    await sequential(address, prompt_len, output_len, 1, token_seed - 1, "warmup", **target)
    samples = await sequential(
        address, prompt_len, output_len, repeats, token_seed, "calib", **target
    )
    ttft = tuple(s[0] for s in samples)
    tpot = tuple(s[1] for s in samples)
    return Calibration(
        config=config,
        prompt_len=prompt_len,
        output_len=output_len,
        prefill_ms=statistics.median(ttft),
        decode_ms=statistics.median(tpot),
        ttft_samples=ttft,
        tpot_samples=tpot,
    )
