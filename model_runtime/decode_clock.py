"""The decode clock: decode-only steps of a `Scheduler` without a pass over every row. Pure:
no torch, no I/O. Runs in the planner's simulator (`tooling/planner/sim_engine.py`), on the
engine's real scheduler.

While every step is decode-only — every running request decoding, nothing to admit — a clock
drives the steps instead of `schedule()` / `update()`, with the same effect on the queues and
the pool, step by step and in the same order (promotion of ready requests, one block per row
when its next position needs one, full blocks registered, rows finishing and freeing their
blocks), but without touching each row's fields at each step: a row's tokens are brought up
to date only when it allocates, registers a block, finishes or is aborted, or when the clock
syncs or stops. A step costs O(log n) per row event instead of O(rows).

The clock changes the scheduler only through its public methods (`promote_ready`,
`promotable`, `register_full_blocks`, `finish_running`) and the block pool; it is tested
against `schedule()` / `update()` from random states
(`tests/unit/test_scheduler_decode_clock.py`).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from model_runtime.request import Request, RequestOutput
from model_runtime.scheduler import Scheduler


def _steps_to_finish(request: Request, token: int) -> int:
    """The decode step (1 = the next) whose sampled `token` ends the decoding `request`."""
    params = request.params
    out = request.num_output_tokens
    steps = params.max_tokens - out
    if (not params.ignore_eos and token in request.eos_token_ids) or (
        token in params.stop_token_ids
    ):
        steps = min(steps, max(1, params.min_tokens - out))
    return max(1, steps)


@dataclass(eq=False)
class _Row:
    """A running request under a `DecodeClock`: its fields are exact as of `done` steps,
    when it had `tokens` tokens; `seq` is its place in the batch; its token of step `end`
    finishes it; `defer`: its full blocks are registered when it leaves or syncs, not as they
    fill (`DecodeClock.start`); `updated`: a step's second half ran for it (a request just
    promoted from `ready` registers nothing before its first, as with `update()`)."""

    request: Request
    seq: int
    done: int
    tokens: int
    end: int
    defer: bool
    updated: bool


class DecodeClock:
    """Decode-only steps of a `Scheduler` without a pass over every row (module docstring).
    One token, `token`, is sampled for every row at every step.

    `start` returns a clock when the scheduler's next step is decode-only. Each step is two
    calls, as `schedule()` and `update()` are: `begin_step()` applies its first half (ready
    requests take free slots; rows whose next position needs a block get one, in batch
    order) and returns the step's (rows, context tokens) — or None when the step is not
    decode-only (a request to admit, or too few free blocks: a preemption), having changed
    nothing but the promotion `schedule()` would make first; the caller then `stop()`s the
    clock and calls `schedule()`. `end_step()` applies the second half: full blocks are
    registered, rows whose token ends them finish and free their blocks (their outputs are
    returned, as `update()` returns them); every other row's tokens count as reported.

    Between the two halves and between steps the caller may change the queues and the pool
    as it could between `schedule()` and `update()` (add requests, reserve, admit remote
    KV), except aborting a row: `forget(request_id)` first. A row's `Request` fields are
    stale until `sync()` (or `stop()`, between steps); the pool, the queues and
    `scheduler.requests` are always exact — except, for the rows `defer` picks, which of
    their in-use blocks carry a hash (below). Rows finish and allocate at the steps the
    step-by-step path gives; a test compares the two bit for bit.

    `defer(request)` True: the row's full blocks are registered with the prefix cache when it
    finishes, is forgotten or syncs, not in the step that fills each. The caller vouches that
    no lookup asks for those hashes meanwhile (the simulator's private prompts: hashes no
    other request has). Nothing else can tell: a block in use is never free nor evicted, and
    it goes back to the pool registered, as in the step-by-step path."""

    def __init__(
        self, scheduler: Scheduler, token: int, defer: Callable[[Request], bool] | None = None
    ) -> None:
        self.scheduler = scheduler
        self.token = token
        self.defer = defer
        self.block_size = scheduler.config.block_size
        self.step = 0  # steps begun
        self.stepping = False  # step `step` has its first half applied, not its second
        self.rows: dict[str, _Row] = {}
        self.step_rows = 0  # rows of the step in progress (aborted ones not counted)
        # sum of (tokens - done - 1) over the rows: step i's context is that + rows * i
        self._sum = 0
        self._seq = 0
        self._tie = itertools.count()
        # (step, seq, tie, row): the first halves where a row takes a block, the second
        # halves where it registers a block or finishes; stale entries (rows gone) skipped
        self._allocs: list[tuple[int, int, int, _Row]] = []
        self._touches: list[tuple[int, int, int, _Row]] = []

    @staticmethod
    def decode_only(scheduler: Scheduler) -> bool:
        """After `schedule()`'s promotion (step 0), no admission could follow: no waiting
        request, or no free slot. (Every running request decoding is the caller's to know.)"""
        s = scheduler
        return not s.waiting or len(s.running) + s.promotable() >= s.config.max_num_seqs

    @classmethod
    def start(
        cls, scheduler: Scheduler, token: int, defer: Callable[[Request], bool] | None = None
    ) -> DecodeClock | None:
        """A clock when the next step is decode-only (every running request decoding and
        `decode_only`), else None. `defer`: class docstring."""
        if not cls.decode_only(scheduler):
            return None
        if not all(r.is_decoding for r in scheduler.running):
            return None
        clock = cls(scheduler, token, defer)
        for r in scheduler.running:
            clock._join(r)
        return clock

    def _join(self, r: Request, updated: bool = True) -> None:
        done = self.step - self.stepping
        n = r.num_tokens
        defer = self.defer is not None and self.defer(r)
        end = done + _steps_to_finish(r, self.token)
        row = _Row(r, self._seq, done, n, end, defer, updated)
        self._seq += 1
        self.rows[r.request_id] = row
        self._sum += n - done - 1
        first_alloc = done + len(r.block_ids) * self.block_size - n + 2
        if first_alloc <= row.end:
            heapq.heappush(self._allocs, (first_alloc, row.seq, next(self._tie), row))
        # the first step registers what is unregistered (a prefilled request's prompt)
        if not defer:
            heapq.heappush(self._touches, (done + 1, row.seq, next(self._tie), row))
        if row.end > done + 1 or defer:
            heapq.heappush(self._touches, (row.end, row.seq, next(self._tie), row))

    def _leave(self, row: _Row) -> None:
        del self.rows[row.request.request_id]
        self._sum -= row.tokens - row.done - 1

    def begin_step(self) -> tuple[int, int] | None:
        """The next step's first half; its (decode rows, context tokens); (0, 0): no rows,
        no step. None: not decode-only (class docstring)."""
        assert not self.stepping, "begin_step twice"
        s = self.scheduler
        if not self.decode_only(s):
            return None
        i = self.step + 1
        for request in s.promote_ready():  # `schedule()` step 0
            self._join(request, updated=False)
        if not self.rows:
            return 0, 0
        due: list[_Row] = []
        allocs = self._allocs
        while allocs and allocs[0][0] <= i:
            row = heapq.heappop(allocs)[3]
            if row.request.request_id in self.rows:
                due.append(row)
        pool = s.block_pool
        if len(due) > pool.num_free:  # `schedule()` would preempt
            for row in due:
                heapq.heappush(allocs, (i, row.seq, next(self._tie), row))
            return None
        for row in due:  # batch order: the heap's order within a step
            new = pool.allocate(1)
            assert new is not None, (row.request.request_id, i)
            row.request.block_ids.extend(new)
            if i + self.block_size <= row.end:
                heapq.heappush(allocs, (i + self.block_size, row.seq, next(self._tie), row))
        self.step, self.stepping = i, True
        self.step_rows = len(self.rows)
        return len(self.rows), self._sum + len(self.rows) * i

    def end_step(self) -> list[RequestOutput]:
        """The step's second half; the outputs of the rows it finished."""
        assert self.stepping, "end_step without begin_step"
        i = self.step
        finished: list[RequestOutput] = []
        touches = self._touches
        while touches and touches[0][0] <= i:
            row = heapq.heappop(touches)[3]
            if row.request.request_id not in self.rows or row.done >= i:
                continue
            self._advance(row, i - 1)
            self._second_half(row, i, finished)
        self.stepping = False
        return finished

    def _advance(self, row: _Row, i: int, register: bool = False) -> None:
        """Bring `row`'s fields to the end of step `i` (< its end; no block to register in
        between: the touches saw to that); `register`: a deferring row's full blocks too."""
        m = i - row.done
        r = row.request
        if m > 0:
            r.extend_tokens(self.token, m)
            r.num_computed_tokens = row.tokens - 1 + m
            r.update_block_hashes(self.block_size)
            r.num_reported_tokens = r.num_output_tokens
            row.done, row.tokens, row.updated = i, row.tokens + m, True
        if register and row.defer and row.updated:
            computed = r.num_computed_tokens
            if min(computed // self.block_size, len(r.block_hashes)) > r.num_registered_blocks:
                self.scheduler.register_full_blocks(r)

    def _second_half(self, row: _Row, i: int, finished: list[RequestOutput]) -> None:
        """Step `i`'s `update()` for `row`, whose fields are exact as of step i - 1."""
        s = self.scheduler
        r = row.request
        bs = self.block_size
        computed = r.num_computed_tokens = row.tokens
        if min(computed // bs, len(r.block_hashes)) > r.num_registered_blocks:
            s.register_full_blocks(r)
        if i == row.end:
            done = r.append_token(self.token)
            assert done, (r.request_id, i)
            s.finish_running(r)
            finished.append(r.make_output())
            self._leave(row)
            return
        r.extend_tokens(self.token, 1)
        r.update_block_hashes(bs)
        r.num_reported_tokens = r.num_output_tokens
        row.done, row.tokens, row.updated = i, row.tokens + 1, True
        nxt = i + bs - computed % bs  # the next step that fills a block
        if nxt < row.end and not row.defer:
            heapq.heappush(self._touches, (nxt, row.seq, next(self._tie), row))

    def sync(self) -> None:
        """Bring every row's fields up to date (the steps ended), deferred blocks registered
        (in batch order)."""
        done = self.step - self.stepping
        for row in self.rows.values():
            self._advance(row, done, register=True)

    def forget(self, request_id: str) -> None:
        """Before the scheduler aborts `request_id`: its fields up to date, and the clock
        forgets it (not a row: nothing)."""
        row = self.rows.get(request_id)
        if row is None:
            return
        self._advance(row, self.step - self.stepping, register=True)
        self._leave(row)
        if self.stepping:
            self.step_rows -= 1

    def stop(self) -> None:
        """Between steps: every row's fields up to date; the scheduler is its own again."""
        assert not self.stepping, "stop inside a step"
        self.sync()
        self.rows.clear()
