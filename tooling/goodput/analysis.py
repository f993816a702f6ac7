"""Goodput maths on request records: SLO attainment, SLO goodput, percentiles, max goodput.

Pure (numpy only); runs in the orchestrator and in `pdserve report`. Definitions (as in
DistServe):

- a request *meets the TTFT SLO* when it succeeded (`RequestRecord.ok`: status OK and every
  requested token arrived) and its client TTFT <= `slo.ttft_ms`; it *meets the TPOT SLO* when it
  succeeded and its TPOT <= `slo.tpot_ms` (a one-token request has no TPOT and meets it).
  Errors, timeouts and rejections miss both. With `slo.long_prompt` set, a request whose prompt
  has at least `long_prompt.min_prompt_tokens` tokens is judged by the long-prompt targets
  instead (per-class SLOs: summarization prompts beside chat turns);
- *attainment* = meeting requests / all requests of the run, for TTFT only, TPOT only, both;
- a run's *SLO goodput* = requests meeting both SLOs / the run's duration (t = 0 to the end of
  the last request), in requests/s (`slo_goodput_rps`, the same name in JSON);
- *max goodput* = the highest tested offered rate whose attainment (both) is >= the target
  (default 0.9); `sweep.max_goodput` decides it, non-monotone attainment included, and
  `repeats` takes its median over trace seeds (`max_goodput_rps` in JSON). Two different
  numbers: a run at 2 req/s with 90% attainment has an SLO goodput of ~1.8 req/s and, if it is
  the highest passing rate, makes the max goodput 2 req/s;
- the *tightest SLO scale* of a run = the smallest `s` such that attainment under
  (s * ttft, s * tpot) is >= the target (`tightest_scale`); inf when errors make it impossible.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from tooling.goodput.records import TIMING_FIELDS, RequestRecord, RunResult

PERCENTILES = (50, 90, 99)
DEFAULT_TARGET = 0.9


@dataclass(frozen=True)
class LongPromptSLO:
    """The SLO class of long prompts: a request whose prompt has >= `min_prompt_tokens` tokens
    is judged by these targets (ms) instead of the base ones, as a summarization request
    beside chat turns is."""

    min_prompt_tokens: int
    ttft_ms: float
    tpot_ms: float

    def __post_init__(self) -> None:
        if self.min_prompt_tokens < 1 or not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(
                "long-prompt SLO: min_prompt_tokens must be >= 1 and the SLOs > 0 ms, got "
                f"{self.min_prompt_tokens}, ttft={self.ttft_ms}, tpot={self.tpot_ms}"
            )

    @classmethod
    def parse(cls, text: str) -> LongPromptSLO:
        """'N:TTFT_MS:TPOT_MS', e.g. '300:6000:85'. ValueError naming the form otherwise."""
        parts = text.split(":")
        try:
            tokens, ttft, tpot = int(parts[0]), float(parts[1]), float(parts[2])
        except (IndexError, ValueError):
            raise ValueError(f"expected MIN_PROMPT_TOKENS:TTFT_MS:TPOT_MS, got {text!r}") from None
        if len(parts) != 3:
            raise ValueError(f"expected MIN_PROMPT_TOKENS:TTFT_MS:TPOT_MS, got {text!r}")
        return cls(tokens, ttft, tpot)

    def text(self) -> str:
        return f"{self.min_prompt_tokens}:{self.ttft_ms:g}:{self.tpot_ms:g}"

    def judges(self, prompt_tokens: int) -> bool:
        """Whether a request with `prompt_tokens` prompt tokens belongs to this class."""
        return prompt_tokens >= self.min_prompt_tokens


@dataclass(frozen=True)
class SLO:
    """Latency objectives in milliseconds; `long_prompt` optionally gives long prompts their
    own (see `LongPromptSLO`)."""

    ttft_ms: float
    tpot_ms: float
    long_prompt: LongPromptSLO | None = None

    def __post_init__(self) -> None:
        if not (self.ttft_ms > 0 and self.tpot_ms > 0):
            raise ValueError(f"SLOs must be > 0 ms, got ttft={self.ttft_ms}, tpot={self.tpot_ms}")

    def scaled(self, s: float) -> SLO:
        lp = self.long_prompt
        long = None if lp is None else replace(lp, ttft_ms=lp.ttft_ms * s, tpot_ms=lp.tpot_ms * s)
        return SLO(self.ttft_ms * s, self.tpot_ms * s, long)

    def for_prompt(self, prompt_tokens: int) -> tuple[float, float]:
        """(TTFT ms, TPOT ms) that a request with `prompt_tokens` prompt tokens is judged by."""
        lp = self.long_prompt
        if lp is not None and lp.judges(prompt_tokens):
            return lp.ttft_ms, lp.tpot_ms
        return self.ttft_ms, self.tpot_ms

    def to_json(self) -> dict[str, Any]:
        """`results.json`'s `meta.slo` (`long_prompt` only when set, so older readers agree)."""
        out: dict[str, Any] = {"ttft_ms": self.ttft_ms, "tpot_ms": self.tpot_ms}
        if self.long_prompt is not None:
            out["long_prompt"] = asdict(self.long_prompt)
        return out

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> SLO:
        lp = d.get("long_prompt")
        long = None if lp is None else LongPromptSLO(
            int(lp["min_prompt_tokens"]), float(lp["ttft_ms"]), float(lp["tpot_ms"])
        )  # fmt: skip
        return cls(float(d["ttft_ms"]), float(d["tpot_ms"]), long)

    def text(self) -> str:
        """'TTFT <= 300 ms, TPOT <= 240 ms' (+ '; prompts >= 300 tokens: TTFT <= ..')."""
        out = f"TTFT <= {self.ttft_ms:g} ms, TPOT <= {self.tpot_ms:g} ms"
        lp = self.long_prompt
        if lp is not None:
            out += (
                f"; prompts >= {lp.min_prompt_tokens} tokens: TTFT <= {lp.ttft_ms:g} ms, "
                f"TPOT <= {lp.tpot_ms:g} ms"
            )
        return out


@dataclass(frozen=True)
class Attainment:
    """Fractions in [0, 1] of `n` requests meeting each SLO; `good` meet both."""

    n: int
    ttft: float
    tpot: float
    both: float
    good: int
    errors: int


def meets(rec: RequestRecord, slo: SLO) -> tuple[bool, bool]:
    """(meets TTFT, meets TPOT) for one request; both False for a failed request."""
    if not rec.ok or rec.ttft_ms is None:
        return False, False
    ttft_ms, tpot_ms = slo.for_prompt(rec.input_len)
    return rec.ttft_ms <= ttft_ms, rec.tpot_ms is None or rec.tpot_ms <= tpot_ms


def attainment(records: Sequence[RequestRecord], slo: SLO) -> Attainment:
    """SLO attainment of a set of requests (all zeros for an empty set)."""
    flags = [meets(r, slo) for r in records]
    n = len(records)
    if n == 0:
        return Attainment(0, 0.0, 0.0, 0.0, 0, 0)
    good = sum(a and b for a, b in flags)
    return Attainment(
        n=n,
        ttft=sum(a for a, _ in flags) / n,
        tpot=sum(b for _, b in flags) / n,
        both=good / n,
        good=good,
        errors=sum(not r.ok for r in records),
    )


def slo_goodput_rps(run: RunResult, slo: SLO) -> float:
    """One run's SLO goodput: requests meeting both SLOs per second of its duration."""
    return attainment(run.records, slo).good / run.duration_s if run.duration_s > 0 else 0.0


def percentiles(values: Iterable[float], qs: Sequence[int] = PERCENTILES) -> dict[str, float]:
    """{"p50": .., "p90": .., "p99": ..} of `values` (NaN for an empty set)."""
    arr = np.asarray(list(values), dtype=float)
    return {f"p{q}": float(np.percentile(arr, q)) if arr.size else math.nan for q in qs}


def latency_summary(records: Sequence[RequestRecord]) -> dict[str, dict[str, float]]:
    """Percentiles of TTFT, TPOT, ITL (every gap of every request, pooled) and E2E in ms,
    over successful requests only."""
    ok = [r for r in records if r.ok]
    return {
        "ttft_ms": percentiles(r.ttft_ms for r in ok if r.ttft_ms is not None),
        "tpot_ms": percentiles(r.tpot_ms for r in ok if r.tpot_ms is not None),
        "itl_ms": percentiles(g for r in ok for g in r.itl_ms),
        "e2e_ms": percentiles(r.e2e_ms for r in ok if r.e2e_ms is not None),
    }


def ttft_breakdown(records: Sequence[RequestRecord]) -> dict[str, float]:
    """Mean server-side TTFT components over successful requests (ms): the `TIMING_FIELDS`,
    `server_other` (server TTFT not covered by them) and `client_other` (client TTFT minus
    server TTFT: network, router streaming, client). Empty when no request has timings."""
    ok = [r for r in records if r.ok and r.server and r.ttft_ms is not None]
    if not ok:
        return {}
    out = {name: float(np.mean([r.server.get(name, 0.0) for r in ok])) for name in TIMING_FIELDS}
    server_ttft = float(np.mean([r.server.get("ttft_ms", 0.0) for r in ok]))
    out["server_other"] = max(0.0, server_ttft - sum(out[n] for n in TIMING_FIELDS))
    out["client_other"] = max(0.0, float(np.mean([r.ttft_ms for r in ok])) - server_ttft)
    return out


def tightest_scale(
    records: Sequence[RequestRecord], slo: SLO, target: float = DEFAULT_TARGET
) -> float:
    """Smallest s with attainment(records, slo.scaled(s)).both >= target (inf if none).

    Request i needs s_i = max(ttft_i / slo.ttft, tpot_i / slo.tpot) (inf if it failed), with
    the SLOs of its prompt's class; the answer is the ceil(target * n)-th smallest s_i."""
    if not records:
        return math.inf
    need = []
    for r in records:
        if not r.ok or r.ttft_ms is None:
            need.append(math.inf)
        else:
            ttft_ms, tpot_ms = slo.for_prompt(r.input_len)
            tpot = 0.0 if r.tpot_ms is None else r.tpot_ms / tpot_ms
            need.append(max(r.ttft_ms / ttft_ms, tpot))
    need.sort()
    k = max(1, math.ceil(target * len(need) - 1e-9))
    return need[k - 1]
