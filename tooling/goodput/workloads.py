"""Synthetic workloads: prompt and output lengths shaped like real traffic, made offline.

Pure numpy, no downloads. Every length is a fraction of a context budget `L` (the model's
context length, or less when the caller caps it, e.g. `--context 1024` on a CPU), so the same
workload is meaningful for any model. `LN(m, s)` is log-normal with median `m` and log-sd `s`;
every draw is rounded and clipped to the range shown, and prompts are cut so that
prompt + output <= L - 1 (the router's limit).

| name | prompt tokens | output tokens | L = 4096 (medians) |
|---|---|---|---|
| chat | LN(L/32, 0.7) in [8, L/2] | LN(L/16, 0.5) in [4, L/4] | 128 in, 256 out |
| code | LN(L/6, 0.3) in [L/16, L/3] | LN(L/64, 0.4) in [2, L/16] | 683 in, 64 out |
| summarize | U(0.6 L, 0.85 L) | LN(L/64, 0.3) in [2, L/16] | ~2970 in, 64 out |
| prefix | shared L/4 + LN(L/32, 0.5) own | LN(L/32, 0.5) in [2, L/8] | 1024+128 in, 128 out |
| multiturn | last prompt + output + LN(L/32, 0.5) | LN(L/32, 0.5) in [2, L/8] | grows per turn |

- `prefix`: `max(2, n // 16)` groups, each with a shared prefix (system prompt) of L/4 tokens;
  each request picks a group uniformly and adds its own suffix.
- `multiturn`: conversations of up to 4 turns (fewer when the next would not fit in L); each
  conversation is a prefix group whose turn k+1 prompt is turn k's prompt + turn k's output
  length + a new user message, so its prompt extends the last one. Conversations run 8 at a
  time: a conversation's next turn comes 8 arrivals after its previous one.

`output_len` (when given) replaces every drawn output length, e.g. to keep a CPU demo short.
Lengths depend only on (workload, n, L, seed, output_len), not on the rate, and the arrival
gaps of one seed are the same draws scaled by 1/rate, so runs at different rates differ only
in how fast the same requests come.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from tooling.goodput.arrivals import ArrivalKind, arrival_times
from tooling.goodput.records import RequestSpec

Lengths = list[tuple[int, int, int | None, int | None]]  # (input, output, group, prefix_len)
MULTITURN_TURNS = 4
MULTITURN_CONCURRENT = 8


def _ln(rng: np.random.Generator, median: float, sigma: float, lo: float, hi: float) -> int:
    return int(np.clip(round(rng.lognormal(np.log(median), sigma)), max(1, lo), max(1, hi)))


def _fit(inp: int, out: int, L: int) -> tuple[int, int]:
    """Clip so that prompt + output <= L - 1 and both are >= 1."""
    out = max(1, min(out, L - 2))
    return max(1, min(inp, L - 1 - out)), out


def _chat(rng: np.random.Generator, n: int, L: int) -> Lengths:
    rows: Lengths = []
    for _ in range(n):
        inp = _ln(rng, L / 32, 0.7, 8, L / 2)
        out = _ln(rng, L / 16, 0.5, 4, L / 4)
        rows.append((*_fit(inp, out, L), None, None))
    return rows


def _code(rng: np.random.Generator, n: int, L: int) -> Lengths:
    rows: Lengths = []
    for _ in range(n):
        inp = _ln(rng, L / 6, 0.3, L / 16, L / 3)
        out = _ln(rng, L / 64, 0.4, 2, L / 16)
        rows.append((*_fit(inp, out, L), None, None))
    return rows


SUMMARIZE_PROMPT_SHARE = (0.6, 0.85)
"""`summarize` prompts draw uniformly between these shares of the context."""


def summarize_min_prompt(context: int) -> int:
    """The shortest `summarize` prompt at `context`. Chat prompts stop at context / 2, so in
    `mixed` a prompt this long or longer is a summarization one (its SLO class)."""
    return int(SUMMARIZE_PROMPT_SHARE[0] * context)


def _summarize(rng: np.random.Generator, n: int, L: int) -> Lengths:
    rows: Lengths = []
    lo, hi = SUMMARIZE_PROMPT_SHARE
    for _ in range(n):
        inp = int(rng.uniform(lo * L, hi * L))
        out = _ln(rng, L / 64, 0.3, 2, L / 16)
        rows.append((*_fit(inp, out, L), None, None))
    return rows


MIXED_SUMMARIZE_SHARE = 0.3
"""`mixed`: the share of requests that are long summarization prompts; the rest are chat turns."""


def _mixed(rng: np.random.Generator, n: int, L: int) -> Lengths:
    chat, summarize = _chat(rng, n, L), _summarize(rng, n, L)
    long = rng.random(n) < MIXED_SUMMARIZE_SHARE
    return [summarize[i] if long[i] else chat[i] for i in range(n)]


def _prefix(rng: np.random.Generator, n: int, L: int) -> Lengths:
    groups = max(2, n // 16)
    shared = max(1, L // 4)
    rows: Lengths = []
    for _ in range(n):
        g = int(rng.integers(groups))
        own = _ln(rng, L / 32, 0.5, 1, L / 4)
        out = _ln(rng, L / 32, 0.5, 2, L / 8)
        inp, out = _fit(shared + own, out, L)
        rows.append((inp, out, g, min(shared, inp)))
    return rows


def _multiturn(rng: np.random.Generator, n: int, L: int) -> Lengths:
    convs: list[list[tuple[int, int]]] = []
    total = 0
    while total < n:
        turns: list[tuple[int, int]] = []
        prompt = 0
        for _ in range(MULTITURN_TURNS):
            user = _ln(rng, L / 32, 0.5, 1, L / 4)
            out = _ln(rng, L / 32, 0.5, 2, L / 8)
            inp = prompt + (turns[-1][1] if turns else 0) + user
            if turns and inp + out > L - 1:
                break
            inp, out = _fit(inp, out, L)
            turns.append((inp, out))
            prompt = inp
        convs.append(turns)
        total += len(turns)
    rows: Lengths = []  # interleave: turn t of every conversation of a batch, then turn t + 1
    for start in range(0, len(convs), MULTITURN_CONCURRENT):
        batch = list(range(start, min(start + MULTITURN_CONCURRENT, len(convs))))
        for t in range(MULTITURN_TURNS):
            rows += [(*convs[c][t], c, None) for c in batch if t < len(convs[c])]
    return rows[:n]


@dataclass(frozen=True)
class Workload:
    """A named length distribution: `lengths(rng, n, L)` draws n rows."""

    name: str
    description: str
    lengths: Callable[[np.random.Generator, int, int], Lengths]


WORKLOADS: dict[str, Workload] = {
    w.name: w
    for w in (
        Workload("chat", "short prompts, medium outputs (log-normal)", _chat),
        Workload("code", "medium prompts, short outputs", _code),
        Workload("summarize", "near-context prompts, short outputs", _summarize),
        Workload(
            "mixed",
            "chat turns and summarization prompts (30 %) arriving together",
            _mixed,
        ),
        Workload("prefix", "groups sharing a long prefix (system prompts)", _prefix),
        Workload("multiturn", "conversations whose next turn extends the last", _multiturn),
    )
}


def make_requests(
    workload: str,
    n: int,
    rate: float,
    *,
    context: int,
    seed: int = 0,
    arrival: ArrivalKind = "poisson",
    cv: float = 1.0,
    output_len: int | None = None,
) -> list[RequestSpec]:
    """`n` requests of `workload` at `rate` requests/s within context budget `context`.
    ValueError names a bad argument (unknown workload, context < 16, output_len < 1)."""
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    if context < 16:
        raise ValueError(f"context must be >= 16 tokens, got {context}")
    if output_len is not None and not 1 <= output_len <= context - 2:
        raise ValueError(f"output_len must be in [1, {context - 2}], got {output_len}")
    rows = WORKLOADS[workload].lengths(np.random.default_rng((seed, 7)), n, context)
    times = arrival_times(n, rate, arrival, cv, seed)
    specs = []
    for i, ((inp, out, group, plen), t) in enumerate(zip(rows, times, strict=True)):
        if output_len is not None:
            inp, out = _fit(inp, output_len, context)
            plen = None if plen is None else min(plen, inp)
        specs.append(RequestSpec(i, t, inp, out, group, plen))
    return specs


def length_summary(specs: list[RequestSpec]) -> dict[str, float]:
    """Mean / median / max prompt and output lengths of a request list (for reports)."""
    inp = np.array([s.input_len for s in specs], dtype=float)
    out = np.array([s.output_len for s in specs], dtype=float)
    if len(specs) == 0:
        return {}
    return {
        "input_mean": float(inp.mean()),
        "input_p50": float(np.median(inp)),
        "input_max": float(inp.max()),
        "output_mean": float(out.mean()),
        "output_p50": float(np.median(out)),
        "output_max": float(out.max()),
    }
