"""Trace files round-trip; prompt token synthesis shares exactly the prefix it should."""

from __future__ import annotations

from pathlib import Path

import pytest

from tooling.goodput.records import RequestRecord, RequestSpec, RunResult
from tooling.goodput.traces import (
    FIRST_ID,
    native_rate,
    prompt_tokens,
    read_trace,
    scale_to_rate,
    write_trace,
)
from tooling.goodput.workloads import make_requests


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
@pytest.mark.parametrize("workload", ["chat", "prefix", "multiturn"])
def test_round_trip(tmp_path: Path, suffix: str, workload: str) -> None:
    specs = make_requests(workload, 40, 3.0, context=1024, seed=1)
    path = write_trace(specs, tmp_path / f"t{suffix}")
    assert read_trace(path) == specs


def test_read_sorts_and_shifts_time(tmp_path: Path) -> None:
    path = tmp_path / "t.csv"
    path.write_text(
        "timestamp,input_len,output_len,prefix_group\n105.5,10,2,\n100.0,20,3,7\n101.0,5,1,7\n"
    )
    specs = read_trace(path)
    assert [(s.arrival_s, s.input_len, s.prefix_group) for s in specs] == [
        (0.0, 20, 7), (1.0, 5, 7), (5.5, 10, None)
    ]  # fmt: skip
    assert native_rate(specs) == pytest.approx(2 / 5.5)
    fast = scale_to_rate(specs, 2.0)
    assert native_rate(fast) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("timestamp,input_len\n0,1\n", "output_len"),
        ("timestamp,input_len,output_len\n0,x,1\n", "request 1"),
        ("timestamp,input_len,output_len\n0,0,1\n", "input_len"),
        ("timestamp,input_len,output_len\n", "no requests"),
    ],
)
def test_bad_traces_name_the_problem(tmp_path: Path, text: str, match: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_trace(path)


def test_prompt_tokens_share_group_prefixes_only() -> None:
    specs = [
        RequestSpec(0, 0.0, 50, 4, prefix_group=1, prefix_len=32),
        RequestSpec(1, 0.1, 40, 4, prefix_group=1, prefix_len=32),
        RequestSpec(2, 0.2, 30, 4, prefix_group=2),  # whole prompt from group 2's stream
        RequestSpec(3, 0.3, 45, 4, prefix_group=2),  # extends request 2 (multi-turn)
        RequestSpec(4, 0.4, 50, 4),
    ]
    toks = prompt_tokens(specs, 1000, token_seed=5)
    assert [len(t) for t in toks] == [50, 40, 30, 45, 50]
    assert all(FIRST_ID <= x < 1000 for t in toks for x in t)
    assert toks[0][:32] == toks[1][:32] and toks[0][32] != toks[1][32]
    assert toks[3][:30] == toks[2]
    assert toks[4][:8] != toks[0][:8]
    assert toks == prompt_tokens(specs, 1000, token_seed=5)
    other = prompt_tokens(specs, 1000, token_seed=6)
    assert all(a[:8] != b[:8] for a, b in zip(toks, other, strict=True))


def _is_window(prompt: list[int], corpus: list[int]) -> bool:
    """`prompt` is a contiguous run of `corpus`, wrapping around its end."""
    ring = corpus * (len(prompt) // len(corpus) + 2)
    return any(ring[i : i + len(prompt)] == prompt for i in range(len(corpus)))


def test_text_prompts_are_corpus_windows_with_the_same_lengths_and_sharing() -> None:
    specs = [
        RequestSpec(0, 0.0, 50, 4, prefix_group=1, prefix_len=32),
        RequestSpec(1, 0.1, 40, 4, prefix_group=1, prefix_len=32),
        RequestSpec(2, 0.2, 30, 4, prefix_group=2),
        RequestSpec(3, 0.3, 45, 4, prefix_group=2),
        RequestSpec(4, 0.4, 150, 4),  # longer than the corpus: wraps around
    ]
    corpus = list(range(5000, 5097))  # 97 distinct "tokens"
    toks = prompt_tokens(specs, 8, token_seed=5, corpus=corpus)
    assert [len(t) for t in toks] == [50, 40, 30, 45, 150]
    assert toks[0][:32] == toks[1][:32] and toks[3][:30] == toks[2]
    # every stream: a corpus window after its first token, itself a corpus token
    assert all(x in corpus for t in toks for x in t)
    assert _is_window(toks[0][1:32], corpus) and _is_window(toks[0][33:], corpus)
    assert _is_window(toks[1][33:], corpus) and toks[0][32] != toks[1][32]
    assert _is_window(toks[2][1:], corpus) and _is_window(toks[3][31:], corpus)
    assert _is_window(toks[4][1:], corpus)
    assert toks == prompt_tokens(specs, 8, token_seed=5, corpus=corpus)
    other = prompt_tokens(specs, 8, token_seed=6, corpus=corpus)
    assert [t[0] for t in other] != [t[0] for t in toks]  # a run's seed moves the windows
    with pytest.raises(ValueError, match="corpus"):
        prompt_tokens(specs, 8, token_seed=5, corpus=[])


def test_run_result_json_round_trip() -> None:
    r = RequestRecord(0, "a", 0.0, 0.001, 10, 4, status="OK", num_tokens=4, ttft_ms=5.0)
    r.tpot_ms, r.e2e_ms, r.itl_ms, r.server = 1.0, 8.0, [1.0, 1.0, 1.0], {"ttft_ms": 4.0}
    run = RunResult("disagg", 2.0, "poisson", 1, 1001, [r], 1.5, 0.2, 0.9, {"x": 1})
    back = RunResult.from_json(run.to_json())
    assert back == run and back.records[0].send_lag_ms == pytest.approx(1.0)


def test_a_load_job_carries_its_corpus_across_the_process_boundary() -> None:
    """The load generator builds text prompts from the job file's corpus (JSON round trip)."""
    import json

    from tooling.goodput.loadgen import LoadJob, build_requests

    corpus = list(range(300, 340))
    specs = [RequestSpec(0, 0.0, 25, 4), RequestSpec(1, 0.5, 60, 4)]
    job = LoadJob(address="127.0.0.1:1", specs=specs, token_seed=3, corpus=corpus)
    again = LoadJob.from_json(json.loads(json.dumps(job.to_json())))
    reqs = build_requests(again, vocab_size=8)
    assert [list(r.token_ids.ids) for r in reqs] == prompt_tokens(specs, 8, 3, corpus)
    assert all(x in corpus for r in reqs for x in r.token_ids.ids)
    assert all(r.sampling.ignore_eos and r.sampling.max_tokens == 4 for r in reqs)
