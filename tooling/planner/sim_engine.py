"""The simulator's one seam to the engine's real scheduler: a simulated worker's
`model_runtime.scheduler.Scheduler` and `BlockPool`, driven without a model, and its KV
hand-off owner (`worker.kv_handoff.KVHandoff`) over a simulated transport
(`sim_transport.SimTransport`). Deterministic; used by `sim.Sim`.

Every call the simulator makes into the scheduler goes through `SimEngine`, so a change of the
scheduler's API is a change here only. What runs is the engine's own code: admission, chunked
prefill, preemption by recompute, block accounting, the prefix cache of the block pool — and
the workers' own hand-off owner, under the names the roles use: the decode worker's
`KVHandoff.reserve` (blocks + ticket), the prefill worker's `KVHandoff.open_send` in the step
that samples the first token (as `prefill_worker/prefill.py` does), `KVHandoff.poll` when the
simulated transfer lands (the send's blocks freed; the reservation RECEIVED), then
`KVHandoff.admit` (as `decode_worker/decode.py` does), and `KVHandoff.abandon` when a request
is dropped.
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

**Decode clock (the fast path).** Most steps of a loaded decode worker are decode-only, and
applying each row of each of them costs tens of microseconds. While the scheduler's steps are
decode-only, `step(fast=True)` drives them with the engine's `DecodeClock` instead of
`schedule()` / `update()`: the same steps (same composition, same duration, same events), the
same changes to the queues and the block pool in the same order, but a row's fields are
brought up to date only when it allocates or registers a block, finishes or is dropped — a
step costs O(log n) per such event instead of a pass over its rows, and a request arriving or
finishing ends nothing. The clock stops (`DecodeClock.stop`) when a step is not decode-only (a
request to admit, a preemption), and the engine steps one by one until the next decode-only
step. Where clocks keep stopping after a step or two (a colocated worker admitting at nearly
every step), starting them costs more than it saves, so the engine then steps one by one for
a while (`MIN_RUN`, `PAUSE_STEPS`). `step(fast=False)` is the step-by-step path
(`Sim(fast=False)`); both give the same simulation, bit for bit (tested).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from model_runtime.block_pool import BlockPool
from model_runtime.decode_clock import DecodeClock
from model_runtime.request import Request, RequestOutput, RequestStatus
from model_runtime.sampling_params import SamplingParams, TopLogprobs
from model_runtime.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from proto.pdserve.v1 import worker_pb2
from tooling.planner.sim_transport import SimTransport, sim_layout
from worker.kv_handoff import HandoffOutcome, KVHandoff

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
    """A scheduled engine step: the scheduler's own output (None: a step of the decode clock,
    `DecodeClock`) and its composition."""

    out: SchedulerOutput | None
    batch: Batch


@dataclass(frozen=True)
class Progress:
    """What one step did for one request that sampled: `new_tokens`, and `finished`."""

    request_id: str
    new_tokens: int
    finished: bool


# Decode clocks that last fewer steps than this on average cost more than the steps they
# replace (starting and stopping one is a pass over the rows); the engine then steps one by
# one for PAUSE_STEPS steps before it tries again. Speed only: both give the same simulation.
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


def _private(request: Request) -> bool:
    """A row whose prompt is private: no other request has its block hashes, so the decode
    clock may register its blocks late (`DecodeClock`, `defer`)."""
    return isinstance(request, LeanRequest) and request.private


def _request(request_id: str, prompt: list[int], max_tokens: int, seed: int) -> LeanRequest:
    """`seed` > 0: a private prompt (`prompt_tokens(seed, n)`)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return LeanRequest(request_id, prompt, params, arrival_time=0.0, private=seed > 0, seed=seed)


def block_hashes(prompt: list[int], block_size: int) -> list[int]:
    """The engine's hash chain of a prompt's full blocks (what the router looks up)."""
    probe = _request("probe", prompt, 1, 0)
    probe.update_block_hashes(block_size)
    return probe.block_hashes


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
        name: str = "sim",
    ) -> None:
        """`name`: the worker id in the tickets its hand-off owner issues."""
        config = SchedulerConfig(
            block_size=block_size,
            max_num_batched_tokens=chunk_tokens,
            max_num_seqs=min(max_num_seqs, chunk_tokens),
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=chunked,
        )
        self.pool = BlockPool(num_blocks, enable_prefix_caching=prefix_caching)
        self.scheduler = Scheduler(config, self.pool)
        self._clock: DecodeClock | None = None  # the decode clock running (module docstring)
        # how long clocks last here (steps, a moving average); while they are too short to
        # pay for themselves, `step` takes the step-by-step path for `_pause` steps
        self._clock_len = float(MIN_RUN)
        self._pause = 0
        # Prefill requests whose KV goes to a decode worker, and the tickets they send to: they
        # open a send in the step that samples their first token, as `PrefillRole` does.
        self._senders: dict[str, worker_pb2.TransferTicket] = {}
        self.transport = SimTransport(name, sim_layout(block_size))
        self.handoff = KVHandoff(self, self.transport, epoch=0)

    # ---- requests in ---------------------------------------------------------------------

    def add(
        self,
        request_id: str,
        prompt: list[int],
        max_tokens: int,
        ticket: worker_pb2.TransferTicket | None = None,
        seed: int = 0,
    ) -> None:
        """Queue a request (`Engine.add_request`); `ticket`: a prefill worker's request, whose
        KV goes to the decode worker that issued the ticket — it opens its send in the step
        that samples its first token and so keeps its blocks until the transfer lands;
        `seed` > 0: its prompt is private (`prompt_tokens(seed, n)`). ValueError when it can
        never run (the scheduler's `add`)."""
        self.scheduler.add(_request(request_id, prompt, max_tokens, seed))
        if ticket is not None:
            self._senders[request_id] = ticket

    def reserve(
        self, request_id: str, num_prompt_tokens: int, max_tokens: int
    ) -> worker_pb2.TransferTicket | None:
        """Decode side of a hand-off: blocks for the request's whole KV and the ticket the
        prefill worker sends to (`KVHandoff.reserve`); None when too few blocks are free.
        ValueError when it could never fit."""
        return self.handoff.reserve(request_id, num_prompt_tokens, max_tokens, 3600.0)

    def land(self, transfer_id: str) -> list[HandoffOutcome]:
        """The simulated transfer `transfer_id` is done: this side's hand-off owner applies
        its result (a send's blocks freed, a reservation RECEIVED) and returns the outcome."""
        self.transport.land(transfer_id)
        outcomes, _ = self.handoff.poll()
        return outcomes

    def admit(self, request_id: str, prompt: list[int], max_tokens: int, seed: int = 0) -> bool:
        """A prefilled request with first token `TOKEN` takes over its RECEIVED reservation
        (`KVHandoff.admit`). True when that first token already ended the request."""
        request = _request(request_id, prompt, max_tokens, seed)
        request.status = RequestStatus.RUNNING
        return self.handoff.admit(request, TOKEN) is not None

    def abort_request(self, request_id: str) -> None:
        """Abort an unfinished request (the decode clock forgets it first); for the hand-off
        owner (`HandoffEngine`)."""
        if self._clock is not None:
            self._clock.forget(request_id)
        self.scheduler.abort(request_id)

    def drop(self, request_id: str) -> None:
        """Give up whatever this worker holds for a request (an aborted drain):
        `KVHandoff.abandon` — an unfinished request is aborted, a send or a reservation given
        up — and the simulated transfer stops at once, so its blocks are freed now."""
        self._senders.pop(request_id, None)
        self.handoff.abandon(request_id)
        outcomes, _ = self.handoff.poll()
        assert not outcomes, outcomes  # only abandoned transfers had news

    # ---- steps ---------------------------------------------------------------------------

    def _stop_clock(self) -> None:
        """The decode clock stops (between steps): the scheduler's requests are up to date."""
        clock = self._clock
        assert clock is not None
        clock.stop()
        self._clock = None
        self._clock_len = 0.75 * self._clock_len + 0.25 * clock.step
        if self._clock_len < MIN_RUN:
            self._pause, self._clock_len = PAUSE_STEPS, float(MIN_RUN)

    def step(self, fast: bool = True) -> Step | None:
        """The next engine step (`Scheduler.schedule`), or None when it has nothing to run.
        `fast`: a step of the decode clock where one can run (module docstring)."""
        if self._clock is None and fast and not self._senders:
            if self._pause:
                self._pause -= 1
            else:
                self._clock = DecodeClock.start(self.scheduler, TOKEN, _private)
        clock = self._clock
        if clock is not None:
            begun = clock.begin_step()
            if begun is not None:
                rows, context = begun
                return Step(None, Batch([], rows, context)) if rows else None
            self._stop_clock()
        out = self.scheduler.schedule()
        if not out.items:
            return None
        chunks: list[tuple[int, int]] = []
        decode = context = 0
        for item in out.items:
            request = self.scheduler.requests[item.request_id]
            if item.samples and item.request_id in self._senders:
                ticket = self._senders.pop(item.request_id)
                self.handoff.open_send(item.request_id, ticket, item.block_table)
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
        many more rows sampled one token each without being listed (a decode clock's step:
        only the rows that finish are listed)."""
        out = step.out
        if out is None:  # a decode clock's step
            clock = self._clock
            assert clock is not None and clock.stepping, clock
            rows = clock.step_rows
            finished = [Progress(o.request_id, 1, True) for o in clock.end_step()]
            return finished, rows - len(finished)
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
        clock = self._clock
        assert clock is not None and not clock.rows, clock
        outs = clock.end_step()  # the second half, on no rows
        assert not outs, outs

    # ---- what the router and the controller see -----------------------------------------

    def busy(self) -> bool:
        """Holds anything: requests, held blocks, reservations."""
        s = self.scheduler
        return bool(s.requests or s.holds_kv())

    def has_work(self) -> bool:
        """Has requests a step could run (held blocks and reservations wait on transfers)."""
        return bool(self.scheduler.requests)

    @property
    def free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        """Waiting to be admitted, prefilled and waiting for a slot, and reservations."""
        s = self.scheduler
        return len(s.waiting) + len(s.ready) + self.handoff.num_reserved()

    @property
    def num_receiving(self) -> int:
        """Of `num_waiting`: reservations whose KV is still to arrive (the worker's
        `num_receiving`)."""
        return self.handoff.num_receiving()

    def queued_tokens(self) -> int:
        """Prompt tokens still to prefill (waiting requests and unfinished prefills): the
        requests that are not decoding (ready ones are, and so are a decode clock's rows,
        whose fields may be stale)."""
        s = self.scheduler
        total = 0
        for r in itertools.chain(s.waiting, s.running if self._clock is None else ()):
            left = len(r.prompt_token_ids) + len(r.output_token_ids) - r.num_computed_tokens
            if left != 1 or not r.output_token_ids:
                total += left
        return total

    def matched_blocks(self, block_hashes: list[int]) -> int:
        """Leading blocks of a hash chain this worker's prefix cache holds (what the router's
        prefix index learns from its KV events)."""
        return len(self.pool.lookup(block_hashes))

    def cached_tokens(self, prompt: list[int], seed: int = 0) -> int:
        """Prompt tokens this worker's prefix cache would give a new request (admission
        reuses full blocks, never the one holding the last token)."""
        bs = self.scheduler.config.block_size
        probe = _request("probe", prompt, 1, seed)
        probe.update_block_hashes(bs)
        reusable = (len(prompt) - 1) // bs
        return len(self.pool.lookup(probe.block_hashes[:reusable])) * bs

    def check(self) -> None:
        """The scheduler's own integrity check (tests)."""
        if self._clock is not None:
            self._clock.sync()
        self.scheduler.check_integrity()
