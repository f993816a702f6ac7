"""Trace files and prompt token synthesis. Pure (file I/O only), used by both processes.

A trace is one row per request: `timestamp` (seconds; any origin), `input_len`, `output_len`,
and optionally `prefix_group` (an int) and `prefix_len` (shared tokens; empty = the whole
prompt). Two encodings, chosen by the file's suffix:

    requests.csv    timestamp,input_len,output_len,prefix_group,prefix_len   (header required)
    requests.jsonl  {"timestamp": 0.0, "input_len": 512, "output_len": 32, "prefix_group": 3}

`read_trace` returns `RequestSpec`s sorted by time with the first arrival moved to t = 0;
`write_trace(read_trace(x))` round-trips. `scale_to_rate` replays the same trace faster or
slower (all gaps scaled so the mean rate is the one asked for).

`prompt_tokens` turns specs into token ids: ids in [FIRST_ID, vocab) (below are the special
tokens), drawn from a per-request stream seeded by (token_seed, index) and, for the first
`shared_len` tokens, from the prefix group's stream seeded by (token_seed, group). Requests of
a group therefore share exactly their common leading tokens, and a different `token_seed` (one
per run) keeps a run from hitting prefix-cache entries left by an earlier one. Given a
`corpus` (token ids of real text, `text_prompts`), each stream is instead a window of that
corpus at a seeded offset: the same lengths and sharing, English instead of random ids.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from tooling.goodput.records import RequestSpec

FIRST_ID = 4
COLUMNS = ("timestamp", "input_len", "output_len", "prefix_group", "prefix_len")


def _opt_int(value: object) -> int | None:
    if value is None or value == "":
        return None
    return int(value)  # type: ignore[call-overload, no-any-return]


def read_trace(path: str | Path) -> list[RequestSpec]:
    """Load a .csv or .jsonl trace. ValueError names the file and line of a bad row."""
    path = Path(path)
    rows: list[dict[str, object]] = []
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            reader = csv.DictReader(f)
            missing = {"timestamp", "input_len", "output_len"} - set(reader.fieldnames or ())
            if missing:
                raise ValueError(f"{path}: header lacks column(s) {sorted(missing)}")
            rows = list(reader)
    elif path.suffix == ".jsonl":
        for line in path.read_text().splitlines():
            if line.strip():
                rows.append(json.loads(line))
    else:
        raise ValueError(f"{path}: trace files must end in .csv or .jsonl")
    parsed: list[tuple[float, int, int, int | None, int | None]] = []
    for i, row in enumerate(rows):
        try:
            parsed.append(
                (
                    float(row["timestamp"]),  # type: ignore[arg-type]
                    int(row["input_len"]),  # type: ignore[call-overload]
                    int(row["output_len"]),  # type: ignore[call-overload]
                    _opt_int(row.get("prefix_group")),
                    _opt_int(row.get("prefix_len")),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: request {i + 1}: {exc!r}") from exc
    if not parsed:
        raise ValueError(f"{path}: the trace has no requests")
    parsed.sort(key=lambda r: r[0])
    t0 = parsed[0][0]
    try:
        return [RequestSpec(i, t - t0, a, b, g, p) for i, (t, a, b, g, p) in enumerate(parsed)]
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def write_trace(specs: Iterable[RequestSpec], path: str | Path) -> Path:
    """Write specs as a .csv or .jsonl trace (by suffix); returns the path."""
    path = Path(path)
    rows = [
        {
            "timestamp": s.arrival_s,
            "input_len": s.input_len,
            "output_len": s.output_len,
            "prefix_group": s.prefix_group,
            "prefix_len": s.prefix_len,
        }
        for s in specs
    ]
    if path.suffix == ".csv":
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=COLUMNS)
            w.writeheader()
            for row in rows:
                w.writerow({k: "" if v is None else repr(v) for k, v in row.items()})
    elif path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    else:
        raise ValueError(f"{path}: trace files must end in .csv or .jsonl")
    return path


def native_rate(specs: list[RequestSpec]) -> float:
    """Mean requests/s of a trace: (n - 1) / span; 0 when it has one request or no span."""
    span = specs[-1].arrival_s - specs[0].arrival_s if specs else 0.0
    return (len(specs) - 1) / span if span > 0 else 0.0


def scale_to_rate(specs: list[RequestSpec], rate: float) -> list[RequestSpec]:
    """The same requests with every arrival time scaled so the mean rate is `rate`."""
    native = native_rate(specs)
    if native <= 0:
        raise ValueError("cannot scale a trace without a time span to a rate")
    k = native / rate
    return [
        RequestSpec(s.index, s.arrival_s * k, s.input_len, s.output_len, s.prefix_group,
                    s.prefix_len)
        for s in specs
    ]  # fmt: skip


def prompt_tokens(
    specs: list[RequestSpec],
    vocab_size: int,
    token_seed: int,
    corpus: Sequence[int] | None = None,
) -> list[list[int]]:
    """Token ids of every spec's prompt (see the module docstring); deterministic. With a
    `corpus` (a token stream, `text_prompts.corpus_ids`), every stream is a window of it at an
    offset drawn from the same seed, wrapping around its end, whose first token is replaced
    by another corpus token drawn from that seed (so two streams that start at one offset
    still differ from their first token: the corpus is short, and a run must not hit the
    prefix cache of another); then `vocab_size` is not used."""
    if corpus is None and vocab_size <= FIRST_ID:
        raise ValueError(f"vocab_size must be > {FIRST_ID}, got {vocab_size}")
    if corpus is not None and len(corpus) == 0:
        raise ValueError("corpus must hold at least one token")
    text = None if corpus is None else np.asarray(corpus, dtype=np.int64)

    def draw(rng: np.random.Generator, n: int) -> list[int]:
        if text is None:
            return rng.integers(FIRST_ID, vocab_size, n).tolist()  # type: ignore[no-any-return]
        start, first = rng.integers(len(text), size=2)
        window = text[(start + np.arange(n)) % len(text)]
        if n:
            window[0] = text[first]
        return window.tolist()  # type: ignore[no-any-return]

    need: dict[int, int] = {}
    for s in specs:
        if s.prefix_group is not None:
            need[s.prefix_group] = max(need.get(s.prefix_group, 0), s.shared_len)
    streams = {g: draw(np.random.default_rng((token_seed, 1, g)), n) for g, n in need.items()}
    out = []
    for s in specs:
        shared = streams[s.prefix_group][: s.shared_len] if s.prefix_group is not None else []
        own = draw(np.random.default_rng((token_seed, 0, s.index)), s.input_len - len(shared))
        out.append(shared + own)
    return out
