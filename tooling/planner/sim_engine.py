"""The simulator's one seam to the engine's real scheduler: a simulated worker's
`model_runtime.scheduler.Scheduler` and `BlockPool`, driven without a model. Pure; used by
`sim.Sim`.

Every call the simulator makes into the scheduler goes through `SimEngine`, so a change of the
scheduler's API is a change here only. What runs is the engine's own code: admission, chunked
prefill, preemption by recompute, block accounting, the prefix cache of the block pool, the
prefill worker's "sending KV" state (`open_send` in the step that samples the first token,
`send_result` when the simulated transfer lands) and the
decode worker's "receiving KV" reservations (`reserve_remote`, `remote_result`,
`admit_remote`), exactly as `prefill_worker/prefill.py` and `decode_worker/decode.py` call them.
The simulator supplies what a model would: one sampled token per item that samples (always
`TOKEN`; requests ignore EOS, so they end by `max_tokens`).

Requests are `LeanRequest`s: the engine's `Request` with the scheduler-facing state unchanged
and three costs a model-less simulator need not pay (a cluster of tens of workers runs minutes of
traffic): outputs carry no token tuples (`make_output`: the new tokens only), `all_token_ids`
is kept as one list instead of concatenated per call, and a *private* prompt (no token ids
given: `prompt_tokens`) gets unique block ids instead of BLAKE2b content hashes — it can share
no block with another request either way, so the prefix cache registers, evicts and misses
exactly as it would. Prompts with token ids hash as the engine does.

`step()` returns the `SchedulerOutput` of the next engine step, already described as the cost
model needs it (`Batch`: prompt chunks as (start, tokens), decode rows and their context);
`finish(out)` applies it as the engine's `update` does, after the step's simulated duration.

**Decode runs (the fast path).** Most steps of a loaded decode worker are decode-only, and
applying each row of each of them costs tens of microseconds. When the scheduler's next steps
are decode-only (`Scheduler.decode_run_limit`), `step(fast=True)` starts a *run*: its steps are
still one simulated step each (same composition, same duration, same events), but the
scheduler is not touched per step. The steps done are applied at once by
`Scheduler.decode_steps` — the engine's own code, equivalent bit for bit to the step-by-step
`schedule()` / `update()` — when the run ends (a row finishes, or its block budget is spent)
and before anything else reads or changes the scheduler (`_sync`): a new request, a
reservation, a transfer's result, a drop, a prefix lookup of a prompt with token ids. A step in
progress then gets its first half (its block allocations) applied, so what is changed next
lands between the step's two halves, as it would between `schedule()` and `update()`; the run
ends with that step. What the router reads without a sync is computed from the run: the free
blocks less the run's allocations not yet applied, and the ready requests its first step
promoted. Where runs keep ending after a step or two (a decode worker admitting a request
at nearly every step), they cost more than they save, so the engine steps one by one for a
while (`MIN_RUN`, `PAUSE_STEPS`). `step(fast=False)` is the step-by-step path
(`Sim(fast=False)`); both give the same simulation.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from model_runtime.block_pool import BlockPool
from model_runtime.request import Request, RequestOutput, RequestStatus
from model_runtime.sampling_params import SamplingParams, TopLogprobs
from model_runtime.scheduler import Receive, Scheduler, SchedulerConfig, SchedulerOutput

TOKEN = 1  # what the simulated model samples
MAX_MODEL_LEN = 1 << 30  # lengths are the planner's to check, not the simulator's


@dataclass(frozen=True)
class Batch:
    """One step's composition, as `costs.CostModel` prices it: prompt chunks (start position,
    tokens) — re-prefills after a preemption included — and `decode` rows whose contexts sum
    to `context` tokens."""

    chunks: list[tuple[int, int]] = field(default_factory=list)
    decode: int = 0
    context: int = 0


@dataclass(frozen=True)
class Step:
    """A scheduled engine step: the scheduler's own output (None: a step of a decode run,
    applied later by `Scheduler.decode_steps`) and its composition."""

    out: SchedulerOutput | None
    batch: Batch


@dataclass
class _Run:
    """A decode run in progress (module docstring). Steps are numbered from 1 in the run.

    `rows`, `context`: the next step's decode rows and their context; `limit`: the run's last
    step (`decode_run_limit`; rows that finish, finish there); `started` / `ended`: steps
    begun / ended; `applied`: steps whose second half the scheduler has; `first_half`: the
    step after those has its first half applied; `ending`: the run stops after the step in
    progress (something changed the scheduler); `firsts`: per residue of the block size, the
    first step at which each row allocates a block (then one every block size steps);
    `pending_alloc`: blocks the begun steps allocate that the pool has not given yet;
    `promoted`: ready requests the first step takes into the batch, until applied."""

    rows: int
    context: int
    limit: int
    block_size: int
    firsts: list[list[int]]
    promoted: int
    started: int = 0
    ended: int = 0
    applied: int = 0
    first_half: bool = False
    ending: bool = False
    pending_alloc: int = 0
    private: bool = False  # every row's prompt is private (`LeanRequest.private`)
    alloc_total: int = 0  # blocks the run's steps allocate in all
    alloc_started: int = 0  # ... of which the begun steps

    def allocs(self, i: int) -> int:
        """Blocks step `i`'s first half allocates."""
        return sum(1 for f in self.firsts[i % self.block_size] if f <= i)


@dataclass(frozen=True)
class Progress:
    """What one step did for one request that sampled: `new_tokens`, and `finished`."""

    request_id: str
    new_tokens: int
    finished: bool


# Decode runs shorter than this on average (steps) cost more than the steps they replace
# (each run is planned and applied over all its rows); the engine then steps one by one for
# PAUSE_STEPS steps before it tries again. Speed only: both paths give the same simulation.
MIN_RUN = 2
PAUSE_STEPS = 8

PRIVATE = 1 << 128  # private block ids lie above every 128-bit content hash


@dataclass(eq=False)
class LeanRequest(Request):
    """The engine's `Request` without the costs a simulator need not pay (module docstring).
    `private`: the prompt shares no block with any other request's (`prompt_tokens`)."""

    private: bool = False
    seed: int = 0
    _all: list[int] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self._all = list(self.prompt_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self._all

    def append_token(
        self, token_id: int, logprob: float = 0.0, top: TopLogprobs | None = None
    ) -> bool:
        self._all.append(token_id)
        return super().append_token(token_id, logprob, top)

    def extend_tokens(self, token_id: int, count: int) -> None:
        tokens = [token_id] * count
        self._all.extend(tokens)
        self.output_token_ids.extend(tokens)
        self.output_logprobs.extend([0.0] * count)
        if self.params.logprobs is not None:
            self.output_top_logprobs.extend([None] * count)

    def update_block_hashes(self, block_size: int) -> None:
        if not self.private:
            super().update_block_hashes(block_size)
            return
        full = len(self._all) // block_size
        have = len(self.block_hashes)
        if full > have:
            base = PRIVATE + (self.seed << 32)
            self.block_hashes.extend(range(base + have, base + full))

    def make_output(self) -> RequestOutput:
        new = tuple(self.output_token_ids[self.num_reported_tokens :])
        self.num_reported_tokens = self.num_output_tokens
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=(),
            output_token_ids=(),
            new_token_ids=new,
            finished=self.is_finished,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
        )


def _request(request_id: str, prompt: list[int], max_tokens: int, seed: int) -> LeanRequest:
    """`seed` > 0: a private prompt (`prompt_tokens(seed, n)`)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return LeanRequest(request_id, prompt, params, arrival_time=0.0, private=seed > 0, seed=seed)


def block_hashes(prompt: list[int], block_size: int) -> list[int]:
    """The engine's hash chain of a prompt's full blocks (what the router looks up)."""
    probe = _request("probe", prompt, 1, 0)
    probe.update_block_hashes(block_size)
    return probe.block_hashes


def _send_id(request_id: str) -> str:
    """The transfer id of a prefill request's (simulated) send."""
    return f"send:{request_id}"


def blocks_for(tokens: int, block_size: int) -> int:
    """KV blocks that hold `tokens` tokens (a decode reservation: prompt + output - 1)."""
    return -(-tokens // block_size)


def prompt_tokens(seed: int, n: int) -> list[int]:
    """A prompt of `n` tokens that shares no block with another seed's (no prefix hits)."""
    return [seed] * n


class SimEngine:
    """One simulated worker's scheduler and block pool (module docstring)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        chunk_tokens: int,
        max_num_seqs: int,
        chunked: bool,
        prefix_caching: bool = True,
    ) -> None:
        config = SchedulerConfig(
            block_size=block_size,
            max_num_batched_tokens=chunk_tokens,
            max_num_seqs=min(max_num_seqs, chunk_tokens),
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=chunked,
        )
        self.pool = BlockPool(num_blocks, enable_prefix_caching=prefix_caching)
        self.scheduler = Scheduler(config, self.pool)
        self._run: _Run | None = None  # the decode run in progress (module docstring)
        # how long runs last here (steps, a moving average); while they are too short to
        # pay for themselves, `step` takes the step-by-step path for `_pause` steps
        self._run_len = float(MIN_RUN)
        self._pause = 0
        # Prefill requests whose KV goes to a decode worker: they open a send in the step that
        # samples their first token, as `PrefillRole.before_forward` does.
        self._senders: set[str] = set()

    # ---- requests in ---------------------------------------------------------------------

    def add(
        self, request_id: str, prompt: list[int], max_tokens: int, hold: bool, seed: int = 0
    ) -> None:
        """Queue a request (`Engine.add_request`); `hold`: a prefill worker's request, which
        opens a send (`_send_id`) in the step that samples its first token and so keeps its
        blocks until `release_held`; `seed` > 0: its prompt is private
        (`prompt_tokens(seed, n)`). ValueError when it can never run (the scheduler's `add`)."""
        self._sync()
        self.scheduler.add(_request(request_id, prompt, max_tokens, seed))
        if hold:
            self._senders.add(request_id)

    def reserve_remote(self, transfer_id: str, num_blocks: int) -> bool:
        """Decode side of a hand-off: reserve blocks for incoming KV (False: too few free).
        A decode run whose begun steps allocate nothing and whose rows' prompts are private
        goes on without a sync: the reservation's blocks come from the pool in the same
        order, and it can evict no block whose hash a row's pending registration holds.
        The run then ends early if its later steps' blocks no longer fit."""
        run = self._run
        if run is None or run.pending_alloc or not run.private:
            self._sync()
            return self.scheduler.reserve_remote(transfer_id, num_blocks) is not None
        if self.scheduler.reserve_remote(transfer_id, num_blocks) is None:
            return False
        if run.alloc_total - run.alloc_started > self.pool.num_free:
            run.limit = run.started  # the steps begun allocate nothing still to come
        return True

    def admit_received(
        self, transfer_id: str, request_id: str, prompt: list[int], max_tokens: int, seed: int = 0
    ) -> bool:
        """The transfer landed: the reservation becomes RECEIVED and a prefilled request with
        first token `TOKEN` takes its blocks over (`Engine.admit_received`). True when that
        first token already ended the request."""
        self._sync()
        received = self.scheduler.remote_result(transfer_id, ok=True)
        assert received, transfer_id
        request = _request(request_id, prompt, max_tokens, seed)
        request.status = RequestStatus.RUNNING
        return self.scheduler.admit_remote(transfer_id, request, TOKEN) is not None

    def release_held(self, request_id: str) -> None:
        """The prefill worker's transfer is done: free the finished request's blocks (the
        send's result)."""
        self._sync()
        self.scheduler.send_result(_send_id(request_id))

    def drop(self, request_id: str, transfer_id: str = "") -> None:
        """Give up whatever this worker holds for a request (an aborted drain): abort it if
        unfinished, free its held blocks, abandon and fail its reservation."""
        self._sync()
        s = self.scheduler
        self._senders.discard(request_id)
        if request_id in s.requests:
            s.abort(request_id)  # an open send keeps the blocks, ABANDONED
        send = _send_id(request_id)
        if s.send_state(send) is not None:
            s.send_result(send)  # the simulated transport stops at once
        if transfer_id and s.remote_state(transfer_id) is not None:
            s.abandon_remote(transfer_id)
            if s.remote_state(transfer_id) is not None:
                s.remote_result(transfer_id, ok=False)

    # ---- steps ---------------------------------------------------------------------------

    def _sync(self) -> list[RequestOutput]:
        """Give the scheduler what the decode run did so far (module docstring): the ended
        steps, and the first half of the one in progress; the run then ends with that step.
        Returns the applied steps' outputs."""
        run = self._run
        if run is None:
            return []
        k = run.ended - run.applied
        in_progress = run.started > run.ended
        then_schedule = in_progress and (k > 0 or not run.first_half)
        outs: list[RequestOutput] = []
        if k or then_schedule:
            outs = self.scheduler.decode_steps(k, TOKEN, run.first_half, then_schedule)
        run.applied, run.first_half = run.ended, in_progress
        run.pending_alloc = run.promoted = 0
        if not run.ending:  # the run ends here: how long it lasted
            run.ending = True
            self._run_len = 0.75 * self._run_len + 0.25 * run.started
            if self._run_len < MIN_RUN:
                self._pause, self._run_len = PAUSE_STEPS, float(MIN_RUN)
        if not in_progress:
            self._run = None
        return outs

    def _start_run(self) -> _Run | None:
        """A decode run from the scheduler's state, when its next steps are decode-only."""
        s = self.scheduler
        limit = s.decode_run_limit(TOKEN)
        if limit < 2:
            return None
        cap = s.config.max_num_seqs
        promoted = min(len(s.ready), max(0, cap - len(s.running)))
        rows = [*s.running, *itertools.islice(s.ready, promoted)]
        if any(r.request_id in self._senders for r in rows):
            return None
        bs = s.config.block_size
        firsts: list[list[int]] = [[] for _ in range(bs)]
        context = 0
        for r in rows:
            n = r.num_tokens
            f = len(r.block_ids) * bs - n + 2
            if f <= limit:
                firsts[f % bs].append(f)
            context += n
        total = sum((limit - f) // bs + 1 for fs in firsts for f in fs)
        private = all(isinstance(r, LeanRequest) and r.private for r in rows)
        return _Run(
            len(rows), context, limit, bs, firsts, promoted, private=private, alloc_total=total
        )

    def step(self, fast: bool = True) -> Step | None:
        """The next engine step (`Scheduler.schedule`), or None when it has nothing to run.
        `fast`: a step of a decode run where one can run (module docstring)."""
        run = self._run
        if run is not None and (run.ending or run.started >= run.limit):
            self._sync()
            run = self._run = None
        if run is None and fast:
            if self._pause:
                self._pause -= 1
            else:
                run = self._run = self._start_run()
        if run is not None:
            run.started += 1
            allocs = run.allocs(run.started)
            run.pending_alloc += allocs
            run.alloc_started += allocs
            batch = Batch([], run.rows, run.context)
            run.context += run.rows
            return Step(None, batch)
        out = self.scheduler.schedule()
        if not out.items:
            return None
        chunks: list[tuple[int, int]] = []
        decode = context = 0
        for item in out.items:
            request = self.scheduler.requests[item.request_id]
            if item.samples and item.request_id in self._senders:
                self._senders.discard(item.request_id)
                self.scheduler.open_send(item.request_id, _send_id(item.request_id))
            n = len(item.token_ids)
            if n == 1 and item.start_pos >= request.num_prompt_tokens and item.samples:
                decode += 1
                context += item.start_pos + 1
            else:
                chunks.append((item.start_pos, n))
        return Step(out, Batch(chunks, decode, context))

    def finish(self, step: Step) -> tuple[list[Progress], int]:
        """Apply a step's results (`Scheduler.update`), one `TOKEN` per sampling item: what
        each request that sampled a token got (partial prompt chunks report nothing), and how
        many more rows sampled one token each without being listed (a decode run's step: only
        the rows that finish are listed)."""
        out = step.out
        if out is None:  # a decode run's step
            run = self._run
            assert run is not None and run.started == run.ended + 1, run
            run.ended += 1
            if run.ended < run.limit and not run.ending:
                return [], run.rows
            finished = [Progress(o.request_id, 1, True) for o in self._sync()]
            return finished, run.rows - len(finished)
        sampled = [TOKEN if item.samples else None for item in out.items]
        progress = [
            Progress(o.request_id, len(o.new_token_ids), o.finished)
            for o in self.scheduler.update(out, sampled)
        ]
        return progress, 0

    def abandon(self, step: Step) -> None:
        """The step in progress is dropped unfinished (every request it ran was dropped)."""
        if step.out is not None:
            return
        run = self._run
        assert run is not None and not self.scheduler.running, run
        self._sync()
        if self.scheduler.decode_scheduled:  # the second half, on no rows
            self.scheduler.decode_steps(1, TOKEN, scheduled=True)
        self._run = None

    # ---- what the router and the controller see -----------------------------------------

    def busy(self) -> bool:
        """Holds anything: requests, held blocks, reservations."""
        s = self.scheduler
        return bool(s.requests or s.sending or s.remote)

    def has_work(self) -> bool:
        """Has requests a step could run (held blocks and reservations wait on transfers)."""
        return bool(self.scheduler.requests)

    @property
    def free_blocks(self) -> int:
        run = self._run
        return self.pool.num_free - (0 if run is None else run.pending_alloc)

    def _promoted(self) -> int:
        run = self._run
        return 0 if run is None or run.started == 0 else run.promoted

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) + self._promoted()

    @property
    def num_waiting(self) -> int:
        """Waiting to be admitted, prefilled and waiting for a slot, and reservations."""
        s = self.scheduler
        return len(s.waiting) + len(s.ready) - self._promoted() + len(s.remote)

    @property
    def num_receiving(self) -> int:
        """Of `num_waiting`: reservations whose KV is still to arrive (the worker's
        `num_receiving`)."""
        return sum(kv.state is Receive.RECEIVING for kv in self.scheduler.remote.values())

    def queued_tokens(self) -> int:
        """Prompt tokens still to prefill (waiting requests and unfinished prefills): the
        requests that are not decoding (ready ones are, and so are a decode run's rows)."""
        s = self.scheduler
        total = 0
        for r in itertools.chain(s.waiting, s.running if self._run is None else ()):
            left = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if left != 1 or not r.output_token_ids:
                total += left
        return total

    def matched_blocks(self, block_hashes: list[int]) -> int:
        """Leading blocks of a hash chain this worker's prefix cache holds (what the router's
        prefix index learns from its KV events)."""
        self._sync()
        return len(self.pool.lookup(block_hashes))

    def cached_tokens(self, prompt: list[int], seed: int = 0) -> int:
        """Prompt tokens this worker's prefix cache would give a new request (admission
        reuses full blocks, never the one holding the last token). A private prompt's blocks
        are its own: no worker holds them before it arrives, so no sync is needed."""
        if not seed:
            self._sync()
        bs = self.scheduler.config.block_size
        probe = _request("probe", prompt, 1, seed)
        probe.update_block_hashes(bs)
        reusable = (len(prompt) - 1) // bs
        return len(self.pool.lookup(probe.block_hashes[:reusable])) * bs

    def check(self) -> None:
        """The scheduler's own integrity check (tests)."""
        self._sync()
        self.scheduler.check_integrity()
