"""The planner's simulator against hand-computable cases: one request's TTFT/TPOT, batched and
chunked prefill, decode batching, CPU sharing, KV capacity, the router's in-flight limit; the
cost fit and overhead calibration; the planner's ranking. Pure, milliseconds."""

from __future__ import annotations

from dataclasses import replace

import pytest

from tooling.planner.costs import (
    CostModel,
    CpuSample,
    Linear,
    calibrate_overheads,
    fit_cpu_overheads,
    fit_linear,
    fit_robust_line,
)
from tooling.planner.planner import goodput_rps, max_rate, plan, rank
from tooling.planner.sim import ClusterSpec, SimRequest, attainment, charged, simulate

# prefill: 10 ms + 1 ms/token; decode: 5 ms + 1 ms/request; transfer 2 ms; overhead 1 ms
COST = CostModel(
    prefill=Linear((0.010, 0.001, 0.0)),
    decode=Linear((0.005, 0.001, 0.0)),
    transfer=Linear((0.002, 0.0)),
    ttft_overhead=Linear((0.001, 0.0)),
)
ONE = ClusterSpec(prefill=1, decode=1)


def test_one_request() -> None:
    (o,) = simulate([SimRequest(1.0, 100, 5)], ONE, COST)
    # TTFT = prefill 10 + 100 ms, transfer 2, overhead 1; 4 decode steps of 6 ms
    assert o.ok and o.ttft_s == pytest.approx(0.113)
    assert o.tpot_s == pytest.approx(0.006)
    assert o.end_s == pytest.approx(1.0 + 0.113 + 4 * 0.006)


def test_one_token_request_ends_at_its_first_token() -> None:
    (o,) = simulate([SimRequest(0.0, 10, 1)], ONE, COST)
    assert o.ok and o.tpot_s is None and o.end_s == pytest.approx(0.023)


def test_simultaneous_prompts_share_one_prefill_step() -> None:
    outs = simulate([SimRequest(0.0, 50, 2), SimRequest(0.0, 60, 2)], ONE, COST)
    # one step of 110 tokens: 120 ms, then 3 ms each
    assert [o.ttft_s for o in outs] == pytest.approx([0.123, 0.123])
    # both join the same decode step: batch 2 -> 7 ms
    assert [o.tpot_s for o in outs] == pytest.approx([0.007, 0.007])


def test_chunked_prefill_splits_a_long_prompt() -> None:
    spec = ClusterSpec(prefill=1, decode=1, chunk_tokens=64)
    (o,) = simulate([SimRequest(0.0, 100, 2)], spec, COST)
    # chunks of 64 and 36 tokens: (10 + 64) + (10 + 36) ms, + 3 ms
    assert o.ttft_s == pytest.approx(0.074 + 0.046 + 0.003)
    whole = ClusterSpec(prefill=1, decode=1, chunk_tokens=64, chunked=False)
    (o,) = simulate([SimRequest(0.0, 100, 2)], whole, COST)
    # the engine's scheduler refuses a whole prompt above the budget: the request fails
    assert not o.ok and o.ttft_s is None


def test_attention_term() -> None:
    cost = CostModel(prefill=Linear((0.0, 0.0, 1e-6)), decode=Linear((0.001, 0.0, 0.0)))
    assert cost.prefill_s([(0, 100)]) == pytest.approx(0.01)  # 100 * 100 * 1 us
    assert cost.prefill_s([(100, 50)]) == pytest.approx(50 * 150 * 1e-6)


def test_second_prompt_queues_behind_the_first() -> None:
    outs = simulate([SimRequest(0.0, 100, 2), SimRequest(0.05, 100, 2)], ONE, COST)
    # the second waits until 110 ms, then its own 110 ms step
    assert outs[1].ttft_s == pytest.approx(0.220 + 0.003 - 0.05)
    two = simulate(
        [SimRequest(0.0, 100, 2), SimRequest(0.05, 100, 2)],
        ClusterSpec(prefill=2, decode=1),
        COST,
    )
    assert two[1].ttft_s == pytest.approx(0.113)  # a second prefill worker takes it at once


def test_cpu_sharing_slows_overlapping_steps() -> None:
    reqs = [SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 2)]
    spec = ClusterSpec(prefill=2, decode=1, cores=1.0)
    outs = simulate(reqs, spec, COST)
    # two 110 ms steps on one core at half speed each: both end at 220 ms
    assert [o.ttft_s for o in outs] == pytest.approx([0.223, 0.223])
    spec2 = ClusterSpec(prefill=2, decode=1, cores=2.0)
    assert simulate(reqs, spec2, COST)[0].ttft_s == pytest.approx(0.113)


def test_kv_capacity_rejects_what_does_not_fit() -> None:
    spec = ClusterSpec(prefill=1, decode=1, num_kv_blocks=10, block_size=16)
    # each needs ceil((100 + 20 - 1) / 16) = 8 blocks: the second finds only 2 free
    outs = simulate([SimRequest(0.0, 100, 20), SimRequest(0.001, 100, 20)], spec, COST)
    assert outs[0].ok and not outs[1].ok and outs[1].ttft_s is None
    # once the first ended its blocks are free again
    later = simulate([SimRequest(0.0, 100, 20), SimRequest(1.0, 100, 20)], spec, COST)
    assert all(o.ok for o in later)


def test_router_inflight_limit_queues() -> None:
    spec = ClusterSpec(prefill=1, decode=1, max_inflight=1)
    outs = simulate([SimRequest(0.0, 100, 5), SimRequest(0.0, 100, 5)], spec, COST)
    first_end = 0.113 + 4 * 0.006
    assert outs[1].ttft_s == pytest.approx(first_end + 0.113)


def test_decode_workers_split_the_batch() -> None:
    reqs = [SimRequest(0.0, 10, 11), SimRequest(0.0, 10, 11)]
    one = simulate(reqs, ONE, COST)
    two = simulate(reqs, ClusterSpec(prefill=1, decode=2), COST)
    assert one[0].tpot_s == pytest.approx(0.007)  # batch 2
    assert two[0].tpot_s == pytest.approx(0.006)  # batch 1 each


def test_attainment_and_goodput() -> None:
    reqs = [SimRequest(0.0, 100, 5), SimRequest(0.05, 100, 5)]
    outs = simulate(reqs, ONE, COST)
    # TTFTs 113 ms and 223 - 50 = 173 ms; each decodes alone: TPOT 6 ms
    assert [o.ttft_s for o in outs] == pytest.approx([0.113, 0.173])
    assert attainment(outs, 0.15, 0.01) == (0.5, 1.0, 0.5)
    assert attainment(outs, 0.2, 0.005) == (1.0, 0.0, 0.0)
    assert goodput_rps(reqs, outs, 0.2, 0.01) == pytest.approx(2 / outs[1].end_s)


def test_fit_linear_recovers_coefficients() -> None:
    xs = [(float(n), float(n * n)) for n in (16, 64, 128, 256, 512)]
    ys = [0.002 + 3e-5 * n + 1e-8 * nn for n, nn in xs]
    fit = fit_linear(xs, ys)
    assert fit.coef == pytest.approx((0.002, 3e-5, 1e-8), rel=1e-6)
    assert fit.rel_err_max < 1e-9
    with pytest.raises(ValueError):
        fit_linear([(1.0,)], [1.0])


def test_calibrate_overheads() -> None:
    samples = [(100, 0.110 + 0.004 + 0.00001 * 100, 0.006 + 0.002)]
    samples.append((300, 0.310 + 0.004 + 0.00001 * 300, None))
    cal = calibrate_overheads(COST, samples)
    assert cal.ttft_overhead.coef == pytest.approx((0.004, 1e-5), rel=1e-6)
    assert cal.token_overhead_s == pytest.approx(0.002)
    # calibrated at batch 1: charged once per decode step whatever the batch
    for batch in (1, 16):
        assert cal.decode_s(batch, 500) == pytest.approx(cal.decode(batch, 500) + 0.002)
    assert cal.transfer(1000) == 0.0
    back = CostModel.from_json(cal.to_json())
    assert back == cal


def test_overhead_fit_is_robust_to_a_near_zero_sample() -> None:
    """The residuals of a real 1P+1D calibration (ms over the engine's prefill step): one 6 ms
    outlier must not pull the overhead to 0, as the 1/y-weighted fit did (2..27 ms)."""
    residual_ms = {32: (47.8, 50.1, 49.2), 128: (123.0, 5.8, 112.8), 384: (29.5, 52.1, 49.7)}
    samples = [
        (n, COST.prefill_s([(0, n)]) + ms / 1e3, None) for n, v in residual_ms.items() for ms in v
    ]
    over = calibrate_overheads(COST, samples).ttft_overhead
    for n in residual_ms:
        assert 0.040 < over(n) < 0.060, (n, over(n))
    line = fit_robust_line([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 30.0, 4.0])  # one wild point
    assert line.coef == pytest.approx((0.0, 1.0))
    assert fit_robust_line([5.0, 5.0], [0.2, 0.4]).coef == pytest.approx((0.3, 0.0))
    assert fit_robust_line([1.0, 2.0], [3.0, 1.0]).coef[1] == 0.0  # never a negative slope


def test_planner_prefers_decode_for_long_outputs_and_prefill_for_long_prompts() -> None:
    cost = CostModel(prefill=Linear((0.001, 0.0001, 0.0)), decode=Linear((0.020, 0.0, 0.0)))
    base = ClusterSpec(prefill=1, decode=1, max_num_seqs=1)
    chatty = [SimRequest(0.05 * i, 20, 50) for i in range(40)]
    rows = plan(chatty, cost, 4, 0.5, 0.05, base)
    assert rows[0].ratio == "1:3"
    cost2 = CostModel(prefill=Linear((0.001, 0.001, 0.0)), decode=Linear((0.001, 0.0, 0.0)))
    prompts = [SimRequest(0.1 * i, 250, 2) for i in range(40)]
    rows = plan(prompts, cost2, 4, 0.3, 0.05, base)
    assert rows[0].ratio == "3:1"
    assert rank(list(reversed(rows))) == rows


def test_max_rate_bisects() -> None:
    def make(rate: float) -> list[SimRequest]:
        return [SimRequest(i / rate, 100, 2) for i in range(30)]

    # prompts take 110 ms each; above 1 / 0.110 s request i waits i * (0.110 - 1 / rate).
    # 27 of 30 (90%) meet TTFT <= 0.2 s while request 26 waits <= 0.087 s:
    # rate <= 1 / (0.110 - 0.087 / 26) = 9.376 req/s
    r = max_rate(make, ONE, COST, 0.2, 1.0, 0.9, lo=1.0, hi=100.0, steps=12)
    assert 9.3 < r <= 1 / (0.110 - 0.087 / 26)
    assert max_rate(make, ONE, COST, 0.05, 1.0, 0.9, lo=1.0, hi=100.0) == 0.0


def test_host_cpu_competes_for_the_cores() -> None:
    cost = CostModel(
        prefill=COST.prefill,
        decode=COST.decode,
        transfer=COST.transfer,
        ttft_overhead=COST.ttft_overhead,
        host_request_s=0.1,
    )
    spec = ClusterSpec(prefill=1, decode=1, cores=1.0)
    (o,) = simulate([SimRequest(0.0, 100, 2)], spec, cost)
    # host (0.1 s) and the 0.11 s prefill step share one core: the host is done at 0.2 s, the
    # step has 0.01 s left then and runs it alone: first token at 0.21 + 0.003
    assert o.ttft_s == pytest.approx(0.213)
    (o,) = simulate([SimRequest(0.0, 100, 2)], ClusterSpec(prefill=1, decode=1), cost)
    assert o.ttft_s == pytest.approx(0.113)  # no shared cores: the host is not modelled


def test_side_cpu_and_charged_steps() -> None:
    cost = CostModel(prefill=COST.prefill, decode=COST.decode, prefill_request_s=0.02)
    (o,) = simulate([SimRequest(0.0, 100, 3)], ONE, cost)
    assert o.ttft_s == pytest.approx(0.110)  # side work does not lengthen the step
    # ... but it shares a core: prefill step and side work of the previous request overlap
    spec = ClusterSpec(prefill=1, decode=1, cores=1.0)
    cost = CostModel(prefill=COST.prefill, decode=COST.decode, prefill_request_s=0.11)
    outs = simulate([SimRequest(0.0, 100, 2), SimRequest(0.0, 100, 2)], spec, cost)
    # both prompts in one 0.21 s step; then their 0.22 s of side work runs alone
    assert [o.ttft_s for o in outs] == pytest.approx([0.21, 0.21])
    got = charged([SimRequest(0.0, 100, 3)], ONE, cost)
    assert got == pytest.approx(
        {
            "prefill_steps_s": 0.110,
            "decode_steps_s": 2 * 0.006,
            "tokens": 3.0,
            "kv_prompt_tokens": 100.0,
        }
    )
    # a step on a 2-thread worker takes CPU on both threads; nothing moves on a colocated one
    two = ClusterSpec(prefill=0, decode=0, colocated=1, threads=2)
    got = charged([SimRequest(0.0, 100, 3)], two, cost)
    assert got["decode_steps_s"] == pytest.approx(2 * (0.110 + 2 * 0.006))
    assert got["kv_prompt_tokens"] == 0.0


def test_kv_side_cpu_is_charged_per_prompt_token_on_both_workers() -> None:
    spec = ClusterSpec(prefill=1, decode=1, cores=1.0)
    base = CostModel(prefill=COST.prefill, decode=COST.decode)
    (alone,) = simulate([SimRequest(0.0, 100, 2)], spec, base)
    # 1 ms of send CPU per prompt token on P: 0.1 s beside P, sharing the core with D's step
    sent = replace(base, prefill_kv_token_cpu_s=0.001)
    (o,) = simulate([SimRequest(0.0, 100, 2)], spec, sent)
    assert o.ttft_s == pytest.approx(alone.ttft_s)  # sent after the step: TTFT unchanged
    assert o.tpot_s > alone.tpot_s  # D's decode step shares the core with the send
    received = replace(base, decode_kv_token_cpu_s=0.001)
    (o,) = simulate([SimRequest(0.0, 100, 2)], spec, received)
    assert o.tpot_s > alone.tpot_s


def test_fit_cpu_overheads() -> None:
    runs = [
        CpuSample(10, 400, 1.0, 4.0, 1.5, 4.39, 10 * 0.01 + 400 * 0.002),
        CpuSample(20, 60, 8.0, 0.5, 9.0, 0.54, 20 * 0.01 + 60 * 0.002),
    ]
    cal = fit_cpu_overheads(COST, runs)
    assert cal.prefill_request_s == pytest.approx(1.5 / 30)
    assert cal.decode_token_cpu_s == pytest.approx(0.43 / (390 + 40))
    assert (cal.host_request_s, cal.host_token_s) == pytest.approx((0.01, 0.002))
    assert (cal.prefill_kv_token_cpu_s, cal.decode_kv_token_cpu_s) == (0.0, 0.0)  # none moved
    assert CostModel.from_json(cal.to_json()) == cal


def test_fit_cpu_overheads_separates_kv_tokens_from_requests() -> None:
    """A chat-like run (short prompts, long outputs) and a summarize-like one (long prompts):
    per request 20 ms + 0.5 ms per KV token sent on P, 1 ms per token + 0.25 ms per KV token
    received on D — the per-request fit of before put the long prompts' KV on every request."""
    chat = (14, 400, 280)  # requests, tokens, KV prompt tokens
    summ = (13, 100, 4600)

    def run(requests: int, tokens: int, kv: int) -> CpuSample:
        pre = requests * 0.020 + kv * 0.0005
        dec = (tokens - requests) * 0.001 + kv * 0.00025
        return CpuSample(requests, tokens, 1.0, 2.0, 1.0 + pre, 2.0 + dec, 0.5, kv)

    cal = fit_cpu_overheads(COST, [run(*chat), run(*summ)])
    assert (cal.prefill_request_s, cal.prefill_kv_token_cpu_s) == pytest.approx((0.02, 0.0005))
    assert (cal.decode_token_cpu_s, cal.decode_kv_token_cpu_s) == pytest.approx((0.001, 0.00025))
