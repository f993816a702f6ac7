"""What one simulated engine step holds and costs, per worker kind. Pure; used by `sim.Sim`.

`compose(spec, cost, w)` admits waiting requests into the step the way the engine's scheduler
does and returns (the step's prompt chunks, its seconds of full-speed work), or None when the
worker has nothing to run:

- prefill: FIFO chunks within `chunk_tokens` and `max_num_seqs` (`chunked=False`: whole
  prompts only; a prompt above the budget runs alone); `cost.prefill_s`;
- decode: waiting requests join the batch up to `max_num_seqs`; `cost.decode_s`;
- colocated: prefilled requests join the decode rows, then waiting requests are admitted while
  their KV blocks fit, then prompt chunks fill the budget the decode rows leave;
  `cost.mixed_s`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from tooling.planner.costs import CostModel
from tooling.planner.sim_types import ClusterSpec, SimRequest
from tooling.planner.sim_workers import Job, Worker

Step = list[tuple[Job, int]]  # (request, prompt tokens it computes in this step)


def blocks(spec: ClusterSpec, r: SimRequest) -> int:
    """KV blocks a request holds: prompt + output - 1 tokens."""
    return math.ceil((r.input_len + r.output_len - 1) / spec.block_size)


def chunks(spec: ClusterSpec, jobs: Sequence[Job], budget: int, seqs: int) -> Step:
    """Prompt chunks of `jobs` (in order) within `budget` tokens and `seqs` requests."""
    step: Step = []
    for job in jobs:
        if len(step) >= seqs or budget <= 0:
            break
        rest = job.req.input_len - job.done
        if not spec.chunked and rest > budget:
            break
        n = min(rest, budget)
        step.append((job, n))
        budget -= n
    return step


def compose(spec: ClusterSpec, cost: CostModel, w: Worker) -> tuple[Step, float] | None:
    """The next step of `w` (module docstring); mutates `w`'s queues as the scheduler does."""
    if w.kind == "prefill":
        step = chunks(spec, w.queue, spec.chunk_tokens, spec.max_num_seqs)
        if not step and w.queue and not spec.chunked:  # above the budget: runs alone
            step = [(w.queue[0], w.queue[0].req.input_len)]
        if not step:
            return None
        return step, cost.prefill_s([(j.done, n) for j, n in step])
    if w.kind == "decode":
        while w.queue and w.dec.batch < spec.max_num_seqs:
            w.dec.join(w.queue.popleft())
        if not w.dec.batch:
            return None
        return [], cost.decode_s(w.dec.batch, w.dec.context)
    while w.queue and w.dec.batch < spec.max_num_seqs and w.queue[0].done:
        w.dec.join(w.queue.popleft())  # prefilled: decodes from this step on
    while (
        w.queue and w.running < spec.max_num_seqs and w.free_blocks >= blocks(spec, w.queue[0].req)
    ):
        job = w.queue.popleft()
        w.free_blocks -= blocks(spec, job.req)
        w.pre.append(job)
    budget = spec.chunk_tokens - w.dec.batch
    step = chunks(spec, w.pre, budget, spec.max_num_seqs - w.dec.batch)
    if not step and not w.dec.batch:
        return None
    work = cost.mixed_s([(j.done, n) for j, n in step], w.dec.batch, w.dec.context)
    return step, work
