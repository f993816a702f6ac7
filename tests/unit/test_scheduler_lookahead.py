"""Speculative decoding's lookahead in the colocated scheduler, driven with fabricated tokens.

A fabricated "model" knows each request's true next tokens (`truth`); a fabricated proposer
guesses some of them right. Numbered steps; `check_integrity` after each, every block free at
the end. The rollback rule under test: rejected proposals' positions fall back beyond
`num_computed_tokens` (no block moves), and accepted ones count as computed.
"""

from __future__ import annotations

from model_runtime.block_pool import BlockPool
from model_runtime.request import Request
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput


def make(num_blocks: int = 16, block_size: int = 4, budget: int = 16) -> Scheduler:
    config = SchedulerConfig(block_size, budget, min(8, budget), 256)
    return Scheduler(config, BlockPool(num_blocks, True))


def truth(request: Request, n_out: int) -> int:
    return 100 + (sum(map(ord, request.request_id)) % 7) * 10 + n_out


def step(s: Scheduler, want: int, right: int) -> tuple[SchedulerOutput, list[int]]:
    """One step: every decoding request wants `want` proposals; the first `right` of the
    granted guesses are the truth, the next one is wrong. Returns the schedule and the
    tokens each item emitted."""
    out = s.schedule(lambda r: want)
    sampled: list[int | None] = []
    accepted = []
    emitted = []
    for it in out.items:
        r = s.requests[it.request_id]
        n = r.num_output_tokens
        if not it.samples:
            sampled.append(None)
            accepted.append(())
            emitted.append(0)
            continue
        kept = min(right, it.num_lookahead)
        accepted.append([(truth(r, n + j), 0.0, None) for j in range(kept)])
        sampled.append(truth(r, n + kept))
        emitted.append(kept + 1)
    s.update(out, sampled, accepted=accepted)
    s.check_integrity()
    return out, emitted


def test_accepted_tokens_count_as_computed_and_rejected_ones_roll_back() -> None:
    s = make()
    s.add(Request("a", list(range(10, 15)), SamplingParams(max_tokens=20)))
    # 1. prefill (5 tokens): no lookahead for a prefill chunk
    out, _ = step(s, want=3, right=0)
    assert out.items[0].num_lookahead == 0
    a = s.requests["a"]
    assert (a.num_computed_tokens, a.num_output_tokens) == (5, 1)
    # 2. decode + 3 proposals, 2 right: 3 tokens out, the 2 kept ones computed
    out, emitted = step(s, want=3, right=2)
    assert out.items[0].num_lookahead == 3 and emitted == [3]
    assert (a.num_computed_tokens, a.num_output_tokens) == (8, 4)
    # the step wrote positions 5..8; 8 (the wrong guess) is beyond computed: rolled back.
    # Blocks for position 8 stay the request's (3 blocks of 4 cover 0..11).
    assert len(a.block_ids) == 3
    # 3. all wrong: one token, nothing more computed than the pending one
    step(s, want=3, right=0)
    assert (a.num_computed_tokens, a.num_output_tokens) == (9, 5)
    # tokens are the truth, in order
    assert a.output_token_ids == [truth(a, n) for n in range(5)]
    # the full blocks hold only computed, accepted tokens: 0..7 registered
    assert a.num_registered_blocks == 2


def test_lookahead_is_capped_by_remaining_tokens_budget_and_free_blocks() -> None:
    # remaining tokens: max_tokens 4, after the first token 3 remain -> at most 2 proposals
    s = make()
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=4)))
    step(s, want=5, right=0)
    out, _ = step(s, want=5, right=5)
    assert out.items[0].num_lookahead == 2
    assert s.requests == {}  # 1 + 1 + 2 = 4 tokens: finished 'length'
    assert s.block_pool.num_free == 16

    # budget: 6 tokens, two decoding requests take 2, the rest goes in order
    s = make(budget=6)
    s.add(Request("a", [1, 2], SamplingParams(max_tokens=50)))
    s.add(Request("b", [3, 4], SamplingParams(max_tokens=50)))
    step(s, want=0, right=0)
    out, _ = step(s, want=3, right=0)
    assert [it.num_lookahead for it in out.items] == [3, 1]  # 6 - 2 rows = 4 extra

    # free blocks: lookahead never preempts; a request short of blocks gets what its own
    # blocks still hold
    s = make(num_blocks=2, block_size=4)
    s.add(Request("a", [1, 2, 3], SamplingParams(max_tokens=5)))
    s.add(Request("b", [4, 5, 6], SamplingParams(max_tokens=5)))
    step(s, want=0, right=0)  # each holds one block, positions 0..3
    out, _ = step(s, want=3, right=0)
    assert [it.num_lookahead for it in out.items] == [0, 0]  # position 3 pending, none free
    assert set(s.requests) == {"a", "b"}  # nobody preempted for a lookahead


def test_a_kept_token_that_ends_the_request_drops_the_rest_and_frees_every_block() -> None:
    s = make()
    eos = 7
    r = Request("a", [1, 2, 3], SamplingParams(max_tokens=30), eos_token_ids=(eos,))
    s.add(r)
    step(s, want=0, right=0)
    out = s.schedule(lambda _: 4)
    assert out.items[0].num_lookahead == 4
    outputs = s.update(out, [55], accepted=[[(40, 0.0, None), (eos, 0.0, None), (41, 0.0, None)]])
    assert outputs[0].finished and outputs[0].finish_reason == "stop"
    assert outputs[0].new_token_ids == (40, eos)
    s.check_integrity()
    assert s.block_pool.num_free == 16


def test_rollback_over_block_boundaries_keeps_the_count() -> None:
    s = make(num_blocks=32, block_size=4)
    for i in range(3):
        s.add(Request(f"r{i}", list(range(20 + i, 26 + i)), SamplingParams(max_tokens=40)))
    pattern = [(4, 1), (4, 4), (2, 0), (4, 3), (1, 1), (4, 2)] * 6
    for want, right in pattern:
        if not s.requests:
            break
        step(s, want, right)
    while s.requests:
        step(s, 2, 1)
    assert s.block_pool.num_free == 32


def test_max_step_rows_grants_oldest_first_and_a_busy_step_none() -> None:
    s = make(num_blocks=64, budget=32)
    for i in range(3):
        s.add(Request(f"r{i}", [1 + i, 2, 3], SamplingParams(max_tokens=50)))
    step(s, want=0, right=0)
    out = s.schedule(lambda _: 4, max_step_rows=8)  # 3 rows + 5 extra: 4 to r0, 1 to r1
    assert [it.num_lookahead for it in out.items] == [4, 1, 0]
    s.update(out, [7, 8, 9])
    s.check_integrity()
    out = s.schedule(lambda _: 4, max_step_rows=3)  # as many decoding requests as rows
    assert [it.num_lookahead for it in out.items] == [0, 0, 0]
    s.update(out, [7, 8, 9])
    s.check_integrity()
