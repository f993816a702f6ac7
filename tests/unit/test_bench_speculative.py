"""`benchmarks/bench_speculative.py`'s arithmetic and table on fabricated runs, and the quoting
workload's prompts (no cluster)."""

from __future__ import annotations

from typing import Any

from benchmarks.bench_speculative import render, summarize
from benchmarks.quoting import TASKS, paragraphs, quoting_messages


def run(tpot: float, text: str = "same") -> dict[str, Any]:
    return {"ttft_ms": 1.0, "tpot_ms": tpot, "tokens": 10, "messages": 4, "text": text}


def test_summary_pairs_ratios_and_counter_deltas() -> None:
    pairs = [
        {"spec": run(5.0), "off": run(10.0)},
        {"spec": run(6.0), "off": run(10.0)},
        {"spec": run(8.0, "a"), "off": run(10.0, "b")},
    ]
    before = {
        "pdserve:spec_decode_num_drafts_total": 1.0,
        "pdserve:spec_decode_num_draft_tokens_total": 4.0,
        "pdserve:spec_decode_num_accepted_tokens_total": 2.0,
    }
    after = {
        "pdserve:spec_decode_num_drafts_total": 11.0,
        "pdserve:spec_decode_num_draft_tokens_total": 44.0,
        "pdserve:spec_decode_num_accepted_tokens_total": 32.0,
    }
    s = summarize(pairs, before, after)
    assert s["tpot_spec_ms"] == 6.0 and s["tpot_off_ms"] == 10.0
    assert s["ratio_of_medians"] == 0.6 and s["median_pair_ratio"] == 0.6
    assert s["acceptance_rate"] == 30 / 40 and s["mean_acceptance_length"] == 1 + 30 / 10
    assert s["identical_answers"] == 2 and s["tokens"] == 30
    table = render(
        {
            "speculative": {"method": "ngram"},
            "dtype": "bfloat16",
            "threads": 2,
            "started": "now",
            "topologies": {"colocated": {"quoting": s}},
            "llamacpp": {"1 thread(s)": {"tpot_ms": 20.0}, "2 thread(s)": {"tpot_ms": 12.0}},
        }
    )
    assert "| colocated | quoting | 6.0 | 10.0 | 0.60x (0.60x) | 0.75 | 4.00 | 10 / 30 | 2/3 |" in (
        table
    )
    assert "best 12.0 ms" in table and "llama.cpp best: 0.50x" in table


def test_quoting_prompts_cycle_tasks_and_paragraphs() -> None:
    msgs = quoting_messages(len(TASKS) * 2)
    paras = paragraphs()
    assert len(paras) > len(TASKS)
    for i, m in enumerate(msgs):
        (only,) = m
        assert only["role"] == "user"
        assert only["content"] == f"{TASKS[i % len(TASKS)]}\n\n{paras[i % len(paras)]}"
