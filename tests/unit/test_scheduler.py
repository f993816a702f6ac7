"""Colocated scheduler driven with fabricated sampled tokens (no model).

Scripted lifecycles with numbered steps; every test ends with every block free again.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from model_runtime.block_pool import BlockPool
from model_runtime.request import Request, RequestOutput, RequestStatus
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput

EOS = 2
TokenFn = Callable[[str, int], int]


def default_token(request_id: str, n_out: int) -> int:
    """Fabricated 'model': a token that depends only on the request and its output position."""
    return 100 + 10 * (sum(map(ord, request_id)) % 7) + n_out


def make(
    num_blocks: int = 16,
    block_size: int = 4,
    budget: int = 16,
    max_seqs: int = 8,
    chunked: bool = True,
    caching: bool = True,
    max_model_len: int = 256,
) -> Scheduler:
    cfg = SchedulerConfig(block_size, budget, max_seqs, max_model_len, chunked)
    return Scheduler(cfg, BlockPool(num_blocks, caching))


def req(rid: str, prompt: list[int] | int, max_tokens: int = 4, **kw: object) -> Request:
    # distinct ids per request, so int prompts never share a prefix by accident
    start = 10 + 100 * (sum(map(ord, rid)) % 50)
    tokens = list(range(start, start + prompt)) if isinstance(prompt, int) else prompt
    params = SamplingParams(max_tokens=max_tokens, **kw)  # type: ignore[arg-type]
    return Request(rid, tokens, params, eos_token_ids=(EOS,))


def step(
    s: Scheduler, token: TokenFn = default_token
) -> tuple[SchedulerOutput, list[RequestOutput]]:
    out = s.schedule()
    sampled = [
        token(it.request_id, s.requests[it.request_id].num_output_tokens) if it.samples else None
        for it in out.items
    ]
    results = s.update(out, sampled)
    s.check_integrity()
    return out, results


def drain(
    s: Scheduler, token: TokenFn = default_token, max_steps: int = 200
) -> dict[str, RequestOutput]:
    finals: dict[str, RequestOutput] = {}
    for _ in range(max_steps):
        if not s.has_unfinished():
            break
        for o in step(s, token)[1]:
            if o.finished:
                finals[o.request_id] = o
    assert not s.has_unfinished(), "did not finish"
    return finals


def assert_all_free(s: Scheduler) -> None:
    s.check_integrity()
    assert s.block_pool.num_free == s.block_pool.num_blocks
    assert not s.running and not s.waiting and not s.requests


def shape(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(i.request_id, i.start_pos, len(i.token_ids), i.samples) for i in out.items]


def test_decode_first_then_chunked_prefill() -> None:
    s = make(budget=8)
    for rid in "ABC":
        s.add(req(rid, 6))
    # 1. A's whole prompt, then a 2-token chunk of B; C does not fit the budget
    out, res = step(s)
    assert shape(out) == [("A", 0, 6, True), ("B", 0, 2, False)]
    assert [r.request_id for r in res] == ["A"] and res[0].new_token_ids == (default_token("A", 0),)
    # 2. A decodes first, then B's remaining 4, then 3 tokens of newly admitted C
    out, _ = step(s)
    assert shape(out) == [("A", 6, 1, True), ("B", 2, 4, True), ("C", 0, 3, False)]
    assert out.items[0].token_ids == [default_token("A", 0)]
    # 3. two decodes, then the rest of C
    out, _ = step(s)
    assert shape(out) == [("A", 7, 1, True), ("B", 6, 1, True), ("C", 3, 3, True)]
    finals = drain(s)
    assert {k: v.finish_reason for k, v in finals.items()} == dict.fromkeys("ABC", "length")
    assert finals["A"].output_token_ids == tuple(default_token("A", i) for i in range(4))
    assert_all_free(s)


def test_chunking_disabled_runs_prompts_whole() -> None:
    s = make(budget=8, chunked=False)
    s.add(req("A", 5))
    s.add(req("B", 5))
    # 1. A whole; B (5 > 3 left) waits: no chunk
    out, _ = step(s)
    assert shape(out) == [("A", 0, 5, True)]
    # 2. A decodes; B whole
    out, _ = step(s)
    assert shape(out) == [("A", 5, 1, True), ("B", 0, 5, True)]
    drain(s)
    assert_all_free(s)
    # a request whose re-prefill could exceed the budget is refused up front
    with pytest.raises(ValueError, match="= 9 exceeds max_num_batched_tokens 8"):
        s.add(req("C", 6, max_tokens=4))


def test_max_num_seqs() -> None:
    s = make(max_seqs=2, budget=32)
    for rid in "ABC":
        s.add(req(rid, 3, max_tokens=2))
    # 1. only two run at once
    out, _ = step(s)
    assert [i.request_id for i in out.items] == ["A", "B"]
    # 2. both decode their last token and finish; C still waits this step
    out, res = step(s)
    assert [i.request_id for i in out.items] == ["A", "B"] and all(r.finished for r in res)
    # 3. C is admitted
    out, _ = step(s)
    assert shape(out) == [("C", 0, 3, True)]
    drain(s)
    assert_all_free(s)


def test_prefix_reuse_full_blocks_only_and_never_last_token() -> None:
    s = make(block_size=4)
    shared = list(range(50, 58))  # two full blocks
    # 1. A computes the shared prefix (+1 token) and finishes; its blocks stay cached
    s.add(req("A", [*shared, 7], max_tokens=1))
    drain(s)
    assert s.block_pool.num_cached == 2
    # 2. B shares both full blocks: it starts at position 8
    s.add(req("B", [*shared, 9, 9, 9], max_tokens=2))
    out, _ = step(s)
    assert shape(out) == [("B", 8, 3, True)]
    # 3. C's prompt IS the shared prefix: its last block must be recomputed for logits
    s.add(req("C", list(shared), max_tokens=2))
    out, res = step(s)
    assert shape(out) == [("B", 11, 1, True), ("C", 4, 4, True)]
    assert res[0].finished and res[0].num_cached_tokens == 8
    finals = drain(s)
    assert finals["C"].num_cached_tokens == 4
    # 4. with caching off nothing is reused
    off = make(caching=False)
    off.add(req("A", [*shared, 7], max_tokens=1))
    drain(off)
    off.add(req("B", [*shared, 9], max_tokens=1))
    out, _ = step(off)
    assert shape(out) == [("B", 0, 9, True)]
    assert_all_free(s)
    assert_all_free(off)


def test_generated_tokens_are_cached_too() -> None:
    s = make(block_size=4)
    # 1. prompt 3 + 6 outputs: positions 0..7 computed (two full blocks) when it finishes
    s.add(req("A", 3, max_tokens=6))
    finals = drain(s)
    tokens = [*finals["A"].prompt_token_ids, *finals["A"].output_token_ids]
    assert s.block_pool.num_cached == 2
    # 2. a follow-up turn that starts with prompt + answer reuses both blocks
    s.add(req("B", [*tokens, 1, 1], max_tokens=1))
    out, _ = step(s)
    assert shape(out) == [("B", 8, 3, True)]
    assert_all_free(s)


def test_preemption_by_recompute_gives_same_tokens() -> None:
    reference = make(num_blocks=64)
    for rid in "ABC":
        reference.add(req(rid, 5, max_tokens=12))
    want = drain(reference)
    # 1. 8 blocks of 4 tokens: three requests needing 5 blocks each cannot all fit
    s = make(num_blocks=8)
    for rid in "ABC":
        s.add(req(rid, 5, max_tokens=12))
    preempted: list[str] = []
    finals: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not s.has_unfinished():
            break
        out, res = step(s)
        preempted += out.preempted_ids
        finals.update({r.request_id: r for r in res if r.finished})
    # 2. the most recently admitted request was preempted first
    assert preempted and preempted[0] == "C"
    # 3. everyone finished with exactly the tokens of the roomy run
    assert {k: v.output_token_ids for k, v in finals.items()} == {
        k: v.output_token_ids for k, v in want.items()
    }
    assert_all_free(s)
    assert_all_free(reference)


def test_preempted_request_reprefills_prompt_and_output() -> None:
    s = make(num_blocks=4, block_size=4, budget=16)
    s.add(req("A", 4, max_tokens=9))
    s.add(req("B", 4, max_tokens=9))
    # 1. both prefill (2 blocks), then decode until blocks run out
    out = None
    for _ in range(10):
        out, _ = step(s)
        if out.preempted_ids:
            break
    assert out is not None and out.preempted_ids == ["B"]
    b = s.requests["B"]
    assert b.status is RequestStatus.PREEMPTED and b.block_ids == [] and b.num_output_tokens > 0
    assert s.waiting[0] is b
    # 2. once A finishes, B runs again: its first item re-runs prompt + output (minus cache)
    n_before = b.num_tokens
    while s.requests["B"].status is not RequestStatus.RUNNING:
        out, _ = step(s)
    b_item = next(i for i in out.items if i.request_id == "B")
    assert b_item.start_pos + len(b_item.token_ids) == n_before and b_item.samples
    drain(s)
    assert b.num_preemptions == 1 and b.output_token_ids[:1] == [default_token("B", 0)]
    assert_all_free(s)


def test_abort_waiting_running_and_unknown() -> None:
    s = make(budget=8, max_seqs=1)
    s.add(req("A", 6))
    s.add(req("B", 6))
    step(s)
    # 1. abort the running one: blocks freed, final output says 'abort'
    out = s.abort("A")
    assert out.finished and out.finish_reason == "abort" and len(out.output_token_ids) == 1
    s.check_integrity()
    # 2. abort the waiting one
    assert s.abort("B").finish_reason == "abort"
    # 3. unknown and already-finished ids are errors, not silent
    with pytest.raises(KeyError, match="'A'"):
        s.abort("A")
    with pytest.raises(KeyError):
        s.abort("nope")
    assert_all_free(s)


def test_stop_rules() -> None:
    s = make()
    stop_at = {"eos": EOS, "stop": 77}

    def token(rid: str, n: int) -> int:
        return stop_at.get(rid, 50) if n == 1 else 40

    s.add(req("eos", 3, max_tokens=5))
    s.add(req("ign", 3, max_tokens=3, ignore_eos=True))
    s.add(req("stop", 3, max_tokens=5, stop_token_ids=(77,)))
    stop_at["ign"] = EOS
    finals = drain(s, token)
    # EOS and stop tokens end the request and are included in the output
    assert finals["eos"].output_token_ids == (40, EOS) and finals["eos"].finish_reason == "stop"
    assert finals["stop"].output_token_ids == (40, 77) and finals["stop"].finish_reason == "stop"
    assert finals["ign"].output_token_ids == (40, EOS, 40)
    assert finals["ign"].finish_reason == "length"
    assert_all_free(s)


def test_add_rejects_impossible_requests() -> None:
    s = make(num_blocks=4, block_size=4, max_model_len=20)
    # prompt + max_tokens beyond the context is the edges' check; here a broken invariant
    with pytest.raises(AssertionError, match="prompt length 21 \\+ max_tokens 4 exceeds"):
        s.add(req("a", 21))
    with pytest.raises(AssertionError, match="prompt length 18 \\+ max_tokens 4 exceeds"):
        s.add(req("a", 18))
    with pytest.raises(ValueError, match="needs 5 KV blocks of 4 tokens, but the KV cache has"):
        s.add(req("a", 12, max_tokens=6))
    with pytest.raises(ValueError, match="prompt is empty"):
        s.add(req("a", []))
    s.add(req("a", 4))
    with pytest.raises(ValueError, match="already in use"):
        s.add(req("a", 4))
    s.abort("a")
    assert_all_free(s)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="max_num_seqs \\(9\\) must not exceed"):
        SchedulerConfig(4, 8, 9, 100)
    with pytest.raises(ValueError, match="block_size must be positive"):
        SchedulerConfig(0, 8, 1, 100)


def test_blocks_registered_only_when_fully_computed() -> None:
    s = make(block_size=4, budget=6, max_seqs=4)
    s.add(req("A", 10, max_tokens=3))
    pool = s.block_pool
    # 1. 6 of 10 prompt tokens computed: block 0 full, block 1 half -> one cached block
    step(s)
    assert pool.num_cached == 1
    # 2. prompt done (10 tokens): two full blocks; the third holds 2 tokens
    step(s)
    assert pool.num_cached == 2
    # 3. a same-prefix request admitted now reuses exactly the two computed blocks
    s.add(req("B", [*s.requests["A"].prompt_token_ids, 1], max_tokens=1))
    out, _ = step(s)
    assert shape(out) == [("A", 10, 1, True), ("B", 8, 3, True)]
    drain(s)
    assert_all_free(s)
