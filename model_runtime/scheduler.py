"""Colocated continuous-batching scheduler (Sarathi-style chunked prefill). Pure: no torch, no I/O.

Runs in the engine thread of a colocated worker. Each `schedule()` builds one step:

1. **Decodes first.** Every running request whose prefill is done gets its one pending token.
   If its next position needs a block and none is free, the most recently admitted request not
   yet scheduled this step is preempted by recompute (possibly the request itself): its blocks
   are freed (their cached hashes survive as evictable blocks), its generated tokens are kept,
   and it goes back to the front of the waiting queue to re-prefill prompt + output later.
2. **Unfinished prefills.** Running requests still prefilling get the next chunk of the
   remaining token budget (`max_num_batched_tokens`), oldest first.
3. **Admission.** If nothing was preempted, waiting requests are admitted in FIFO order while
   budget, `max_num_seqs` and free blocks allow (the head blocks the queue: no skipping ahead).
   Free running slots go first come, first served between waiting requests and prefilled ones
   (`ready`, below), in the order the scheduler took them (`Request.queued_seq`): prefilled
   requests that came before the waiting head take slots at step 0 (and decode in that step),
   and admission stops at a waiting request that came after the oldest prefilled one. So a
   decode worker that also prefills locally (hybrid) never starves its local prompts behind a
   stream of prefilled arrivals. One exception keeps slots from waiting on a head that cannot
   run: when the free blocks (which prefilled requests may hold) cannot cover the head's
   admission, prefilled requests take the free slots regardless of age.
   Admission reuses prefix-cached blocks — only full blocks, and never the block holding the
   last token, since at least one token must run to produce logits — and allocates blocks for
   *all* of the request's remaining known tokens at once, so a prefill never stalls for blocks.
   With chunked prefill off, a request is admitted only if its whole prefill fits the budget.

**Lookahead** (speculative decoding): `schedule(lookahead)` asks, for each decoding request,
how many proposed tokens its engine wants to verify after the pending one (`lookahead(request)`,
the request's adaptive k). After every decoding request has its one token, each gets up to that
many extra positions, capped by its remaining `max_tokens` (so its KV never outgrows prompt +
max_tokens - 1, the worst case a decode worker reserves), by the step's remaining token budget,
by free blocks: lookahead takes blocks only when they are free and never preempts (a
request short of blocks verifies fewer proposals), and by `max_step_rows`, the decode rows
(pending tokens plus proposals) the step may have in all, granted oldest request first.
`ScheduledRequest.num_lookahead` is the grant; the engine fills at most that many proposals.

`update()` advances each scheduled request by its tokens, registers newly computed full blocks
with the pool's prefix cache (prompt and generated tokens alike), appends the sampled tokens,
and frees the blocks of finished requests (tail first, so their heads stay cached longest).
A verified step's accepted proposals (`update(..., accepted=)`) are appended before its sampled
token and count as computed (their K/V was written by the step); the K/V the step wrote for
rejected proposals lies beyond `num_computed_tokens`, where the next step overwrites it. That
is the whole rollback: no block changes hands, the blocks granted for the lookahead stay the
request's (within its worst case) and `check_integrity` counts them as before. Prefix caching
never sees a rejected token: a block is registered only once its computed tokens fill it, and
its hash comes from the request's tokens (accepted ones only).

Two entry/exit paths serve disaggregated workers:

- **Prefilled requests** (`add_prefilled`, decode worker): the prompt's KV is already in blocks
  the caller allocated and hands over, and the first token is known. The request waits in
  `ready` (holding its blocks) until a running slot is its turn (step 3's order), then joins
  `running` as a decoding request.
- **Sending KV** (prefill worker; vLLM v1's connector `request_finished` delayed free):
  `open_send(request_id, transfer_id)` records, in the step that samples a request's first
  token, that the transport now reads its blocks (a live send, keyed by request id). When
  that request finishes its blocks are not freed but stay with the send until the transport's
  result (`send_result`), which frees them. A request with no open send (its open failed, or
  none was asked for) frees its blocks when it finishes, as any other.
- **Receiving KV** (decode worker; vLLM v1's WAITING_FOR_REMOTE_KVS): `reserve_remote` takes
  blocks for a transfer that will write them, keyed by request id, in state RECEIVING. The
  transport's result (`remote_result`) makes them RECEIVED or, on failure, frees them;
  `admit_remote` hands RECEIVED blocks to the prefilled request of the same id.
- **Abandoned KV**: a send or a reservation given up while the transport may still read or
  write its blocks (`abandon_send`; `abort` of a running request whose send is open;
  `abandon_remote` of a RECEIVING reservation) leaves its request: the blocks move to
  `abandoned`, keyed by the transfer's id, until the transport's result for that transfer
  (`release_abandoned`) frees them. The request id is free again at once (a router retrying
  the request here reuses it), while the earlier transfer's blocks wait for its result. A
  RECEIVED reservation given up is freed at once (the transport is done with it).

Who calls these: `worker.kv_handoff.KVHandoff`, the one place a worker pairs its KV transport
with this scheduler (and, over a simulated transport, the planner's simulator).

The planner's simulator drives decode-only steps through a `DecodeClock`
(`model_runtime/decode_clock.py`) instead, with the same effect on the queues and the pool.

Every block is freed exactly once, or handed over once: each path above removes the request or
the transfer entry that held it, and `check_integrity` counts every holder (running and ready
requests, sends, reservations, abandoned transfers) against the pool's reference counts.
"""

from __future__ import annotations

import enum
import itertools
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from model_runtime.block_pool import BlockPool
from model_runtime.request import Request, RequestOutput, RequestStatus
from model_runtime.sampling_params import TopLogprobs
from model_runtime.scheduler_types import (
    AcceptedToken,
    ScheduledRequest,
    SchedulerConfig,
    SchedulerOutput,
)

__all__ = ["AcceptedToken", "ScheduledRequest", "Scheduler", "SchedulerConfig", "SchedulerOutput"]

Lookahead = Callable[[Request], int]
"""How many proposed tokens a decoding request wants verified after its pending one."""


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class Receive(enum.Enum):
    """Where the KV of a live reservation (`Scheduler.reserve_remote`) stands."""

    RECEIVING = "receiving"  # the transport may write the blocks
    RECEIVED = "received"  # the transport reported every layer written; no admission yet


@dataclass
class RemoteKV:
    """A request's reserved blocks, which the transfer `transfer_id` writes, and their state."""

    transfer_id: str
    block_ids: list[int]
    state: Receive = Receive.RECEIVING


@dataclass
class SendingKV:
    """The request whose blocks the transfer `transfer_id` reads. The blocks are the request's
    (`request.block_ids`) while it runs and stay with this entry once it finishes."""

    transfer_id: str
    request: Request


@dataclass
class AbandonedKV:
    """The blocks of a transfer whose request was given up while the transport may still read
    (`side` "send") or write ("recv") them: nobody's request any more, freed at the
    transport's result for `transfer_id` (`Scheduler.release_abandoned`)."""

    transfer_id: str
    request_id: str
    side: Literal["send", "recv"]
    block_ids: list[int]


class Scheduler:
    """Owns the waiting queue and the running batch of one engine; see the module docstring."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool) -> None:
        self.config = config
        self.block_pool = block_pool
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: oldest first
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.ready: deque[Request] = deque()  # prefilled, holding blocks, waiting for a slot
        self.sending: dict[str, SendingKV] = {}  # live sends the transport reads, by request id
        self.remote: dict[str, RemoteKV] = {}  # live reservations for incoming KV, by request id
        self.abandoned: dict[str, AbandonedKV] = {}  # given up in flight, by transfer id
        self._queued = itertools.count()  # Request.queued_seq: first come, first served

    # ------------------------------------------------------------------ requests in and out

    def add(self, request: Request) -> None:
        """Queue a new request. Raise ValueError if it could never run to completion: duplicate
        id, empty prompt, more KV blocks than the pool has, or (chunked prefill off) a
        re-prefill larger than the budget. Prompt + max_tokens within `max_model_len` is the
        caller's to check (`model_runtime.limits.check_context`); asserted here."""
        cfg = self.config
        rid = request.request_id
        if self._in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        n_prompt = request.num_prompt_tokens
        max_tokens = request.params.max_tokens
        if n_prompt == 0:
            raise ValueError(f"request {rid!r}: prompt is empty")
        # checked at the edges (`model_runtime.limits.check_context`): an invariant here
        assert n_prompt + max_tokens <= cfg.max_model_len, (
            f"request {rid!r}: prompt length {n_prompt} + max_tokens {max_tokens} exceeds "
            f"max_model_len {cfg.max_model_len}"
        )
        # The last generated token is never run, so the KV holds at most this many tokens.
        kv_tokens = n_prompt + max_tokens - 1
        need = _blocks_for(kv_tokens, cfg.block_size)
        if need > self.block_pool.num_blocks:
            raise ValueError(
                f"request {rid!r}: prompt length {n_prompt} + max_tokens {max_tokens} needs "
                f"{need} KV blocks of {cfg.block_size} tokens, but the KV cache has only "
                f"{self.block_pool.num_blocks}"
            )
        if not cfg.enable_chunked_prefill and kv_tokens > cfg.max_num_batched_tokens:
            raise ValueError(
                f"request {rid!r}: prompt length {n_prompt} + max_tokens {max_tokens} - 1 = "
                f"{kv_tokens} exceeds max_num_batched_tokens {cfg.max_num_batched_tokens}; "
                "with chunked prefill off a (re-)prefill must fit one step"
            )
        request.status = RequestStatus.WAITING
        request.update_block_hashes(cfg.block_size)
        request.queued_seq = next(self._queued)
        self.requests[rid] = request
        self.waiting.append(request)

    def add_prefilled(self, request: Request, first_token: int) -> RequestOutput | None:
        """Take over a request whose prompt KV is already in `request.block_ids` and whose first
        output token is `first_token` (sampled elsewhere).

        The caller allocated the blocks (ref count 1 each) and hands them over: from now on the
        scheduler frees them. They must cover at least the prompt. If `first_token` already ends
        the request, its blocks are freed and its final output returned; else the request waits
        in `ready` for a running slot and None is returned. The first token is never reported
        again (`new_token_ids` of later outputs start after it).
        Raises ValueError for a duplicate id or too few blocks (nothing is taken over then).
        """
        rid = request.request_id
        bs = self.config.block_size
        if self._in_use(rid):
            raise ValueError(f"request id {rid!r} is already in use")
        if len(request.block_ids) * bs < request.num_prompt_tokens:
            raise ValueError(
                f"request {rid!r}: {len(request.block_ids)} blocks of {bs} tokens cannot hold "
                f"its {request.num_prompt_tokens} prompt tokens"
            )
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_registered_blocks = 0  # registered by the next update(): KV is valid now
        finished = request.append_token(first_token)
        request.num_reported_tokens = request.num_output_tokens
        if finished:
            self._release_blocks(request)
            return request.make_output()
        request.status = RequestStatus.WAITING
        request.update_block_hashes(bs)
        request.queued_seq = next(self._queued)
        self.requests[rid] = request
        self.ready.append(request)
        return None

    # ------------------------------------------------------------------ receiving KV

    def reserve_remote(
        self, request_id: str, transfer_id: str, num_blocks: int
    ) -> list[int] | None:
        """Blocks for `request_id`'s incoming KV, which transfer `transfer_id` writes (state
        RECEIVING), or None when fewer are free. ValueError for a request id already in use
        here (a reservation, a request or a live send)."""
        if request_id in self.remote or self._in_use(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        assert transfer_id not in self.abandoned, (transfer_id, "reused while abandoned")
        blocks = self.block_pool.allocate(num_blocks)
        if blocks is not None:
            self.remote[request_id] = RemoteKV(transfer_id, blocks)
        return blocks

    def remote_state(self, request_id: str) -> Receive | None:
        """The live reservation's state (None: none, or it ended)."""
        kv = self.remote.get(request_id)
        return None if kv is None else kv.state

    def remote_result(self, request_id: str, ok: bool) -> bool:
        """The transport's one result for the live reservation of `request_id`: True when
        the blocks are now RECEIVED; else they were freed. KeyError for no reservation."""
        kv = self.remote[request_id]
        assert kv.state is Receive.RECEIVING, f"request {request_id!r}: a second result"
        if ok:
            kv.state = Receive.RECEIVED
            return True
        del self.remote[request_id]  # once: a second result finds no reservation
        self._free(kv.block_ids)
        return False

    def abandon_remote(self, request_id: str) -> bool:
        """Give up the live reservation of `request_id`: RECEIVED blocks are freed now
        (False); RECEIVING ones move to `abandoned` until the transport's result (True: the
        caller cancels the transfer). KeyError for no reservation."""
        kv = self.remote.pop(request_id)
        if kv.state is Receive.RECEIVED:
            self._free(kv.block_ids)
            return False
        self._abandon(AbandonedKV(kv.transfer_id, request_id, "recv", kv.block_ids))
        return True

    def admit_remote(self, request: Request, first_token: int) -> RequestOutput | None:
        """`add_prefilled` with the RECEIVED blocks reserved for `request.request_id`, which
        leave the reservation (the request frees them). On ValueError nothing is taken over:
        the reservation stays RECEIVED."""
        rid = request.request_id
        kv = self.remote[rid]
        assert kv.state is Receive.RECEIVED, (rid, kv.state)
        request.block_ids = list(kv.block_ids)
        try:
            out = self.add_prefilled(request, first_token)
        except ValueError:
            request.block_ids = []
            raise
        del self.remote[rid]
        return out

    # ------------------------------------------------------------------ sending KV

    def open_send(self, request_id: str, transfer_id: str) -> None:
        """The transport reads the blocks of the running request `request_id` for
        `transfer_id` from now on: when the request finishes they stay held until
        `send_result`. ValueError for a request that is not running or already sends."""
        request = self.requests.get(request_id)
        if request is None or request.status is not RequestStatus.RUNNING:
            raise ValueError(f"request {request_id!r} is not running: no blocks to send")
        if request_id in self.sending:
            raise ValueError(f"request {request_id!r} already sends")
        assert transfer_id not in self.abandoned, (transfer_id, "reused while abandoned")
        self.sending[request_id] = SendingKV(transfer_id, request)

    def sends(self, request: Request) -> bool:
        """Whether a live send reads `request`'s blocks."""
        kv = self.sending.get(request.request_id)
        return kv is not None and kv.request is request

    def send_result(self, request_id: str) -> None:
        """The transport's one result for the live send of the finished request
        `request_id`, ok or not: the transport never reads the blocks again, so they are
        freed now. KeyError for no live send."""
        kv = self.sending[request_id]
        request = kv.request
        assert request.status is RequestStatus.FINISHED, (
            f"transfer {kv.transfer_id!r}: result before request {request_id!r} finished"
        )
        del self.sending[request_id]  # once: a second result finds no send
        self._release_blocks(request)

    def abandon_send(self, request_id: str) -> None:
        """Give up the live send of the finished request `request_id`: its blocks move to
        `abandoned` until the transport's result. KeyError for no live send."""
        kv = self.sending[request_id]
        assert kv.request.status is RequestStatus.FINISHED, (request_id, kv.request.status)
        self._abandon_send(kv)

    def _abandon_send(self, kv: SendingKV) -> None:
        request = kv.request
        del self.sending[request.request_id]
        self._abandon(AbandonedKV(kv.transfer_id, request.request_id, "send", request.block_ids))
        request.block_ids = []
        request.num_registered_blocks = 0

    # ------------------------------------------------------------------ abandoned KV

    def _abandon(self, kv: AbandonedKV) -> None:
        assert kv.transfer_id not in self.abandoned, (kv.transfer_id, "abandoned twice")
        self.abandoned[kv.transfer_id] = kv

    def release_abandoned(self, transfer_id: str) -> AbandonedKV:
        """The transport's one result for the abandoned transfer `transfer_id`: its blocks
        are freed now. KeyError for an unknown id (freed exactly once)."""
        kv = self.abandoned.pop(transfer_id)
        self._free(kv.block_ids)
        return kv

    def num_parked(self) -> int:
        """Finished requests whose blocks a send still holds (live or abandoned)."""
        live = sum(1 for kv in self.sending.values() if kv.request.status is RequestStatus.FINISHED)
        return live + sum(1 for kv in self.abandoned.values() if kv.side == "send")

    def holds_kv(self) -> bool:
        """Blocks held beside the requests: live sends, reservations, abandoned transfers."""
        return bool(self.sending or self.remote or self.abandoned)

    def _in_use(self, request_id: str) -> bool:
        """Unfinished, or finished with its blocks still held by a live send."""
        return request_id in self.requests or request_id in self.sending

    def _free(self, block_ids: list[int]) -> None:
        self.block_pool.free(list(reversed(block_ids)))

    def abort(self, request_id: str) -> RequestOutput:
        """Finish an unfinished request with reason 'abort', freeing its blocks.

        Raises KeyError for an id that is unknown or already finished (a finished request
        whose send holds its blocks: use `abandon_send`). A running request whose send is open
        leaves its blocks to `abandoned`: the transport reads them until its result.
        """
        request = self.requests.get(request_id)
        if request is None:
            raise KeyError(f"no unfinished request with id {request_id!r}")
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            if self.sends(request):
                self._abandon_send(self.sending[request_id])  # freed at the transport's result
            else:
                self._release_blocks(request)
        elif request in self.ready:
            self.ready.remove(request)
            self._release_blocks(request)
        else:
            self.waiting.remove(request)
        request.finish("abort")
        del self.requests[request_id]
        return request.make_output()

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ one step

    def schedule(
        self, lookahead: Lookahead | None = None, max_step_rows: int | None = None
    ) -> SchedulerOutput:
        """Choose this step's work (see the module docstring, steps 1-3; `lookahead`:
        speculative decoding's extra positions per decoding request, none when None, within
        `max_step_rows` decode rows in all, if given)."""
        budget = self.config.max_num_batched_tokens
        items: list[ScheduledRequest] = []
        scheduled: set[str] = set()
        preempted: list[str] = []

        # 0. prefilled requests take free running slots in their turn (their blocks are
        #    already held); they decode in this step
        self.promote_ready()

        # 1. one token for every decoding request, then the lookahead each may have
        decoding: list[Request] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or not request.is_decoding:
                continue
            if not self._ensure_blocks(request, request.num_tokens, scheduled, preempted):
                continue
            decoding.append(request)
            scheduled.add(request.request_id)
            budget -= 1
        rows = budget if max_step_rows is None else max_step_rows - len(decoding)
        for request in decoding:
            extra = 0
            if lookahead is not None and rows > 0:
                extra = self._grant_lookahead(request, lookahead, min(budget, rows))
            items.append(self._item(request, 1, extra))
            budget -= extra
            rows -= extra

        # 2. next chunk of every unfinished prefill (blocks were allocated at admission)
        for request in self.running:
            if budget <= 0:
                break
            if request.request_id in scheduled:
                continue
            n = min(request.num_tokens - request.num_computed_tokens, budget)
            items.append(self._item(request, n))
            scheduled.add(request.request_id)
            budget -= n

        # 3. admission, unless this step had to preempt; a waiting request that came after
        #    the oldest prefilled one leaves the slot to it (taken at the next step's step 0)
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                head = self.waiting[0]
                if self.ready and self.ready[0].queued_seq < head.queued_seq:
                    break
                admitted = self._admit(head, budget)
                if admitted is None:
                    break
                self.waiting.popleft()
                items.append(self._item(head, admitted))
                budget -= admitted
        return SchedulerOutput(items, preempted)

    def promote_ready(self) -> list[Request]:
        """Step 0 of `schedule()`: prefilled requests take free running slots, oldest first,
        while they came before the waiting head — or the head cannot be admitted for want of
        free blocks (which the prefilled requests may be holding: a slot never waits on a
        head that cannot run). Returns them, in order."""
        out = []
        for _ in range(self.promotable()):
            out.append(self._promote(self.ready.popleft()))
        return out

    def promotable(self) -> int:
        """How many `ready` requests `promote_ready` moves now (it changes nothing)."""
        free = max(0, self.config.max_num_seqs - len(self.running))
        n = min(free, len(self.ready))
        if not self.waiting or n == 0 or not self._fits(self.waiting[0]):
            return n
        head = self.waiting[0].queued_seq
        return sum(1 for _, r in zip(range(n), self.ready, strict=False) if r.queued_seq < head)

    def _fits(self, request: Request) -> bool:
        """Whether the free blocks (prefix hits included) cover the waiting `request`'s
        admission, as `_admit` counts them."""
        bs = self.config.block_size
        pool = self.block_pool
        hits = pool.lookup(request.block_hashes[: (request.num_tokens - 1) // bs])
        revived = sum(1 for b in hits if pool.ref_count(b) == 0)
        return _blocks_for(request.num_tokens, bs) - len(hits) + revived <= pool.num_free

    def _promote(self, request: Request) -> Request:
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def update(
        self,
        output: SchedulerOutput,
        sampled_token_ids: Sequence[int | None],
        logprobs: Sequence[float] | None = None,
        top_logprobs: Sequence[TopLogprobs | None] | None = None,
        accepted: Sequence[Sequence[AcceptedToken]] | None = None,
    ) -> list[RequestOutput]:
        """Apply a step's results; return an output for every request that got a new token.

        `sampled_token_ids[i]` (and `logprobs[i]`, `top_logprobs[i]`, if given) belong to
        `output.items[i]`: a token for items with `samples=True`, None for partial prefill
        chunks. `accepted[i]` (if given): the proposals item i's step verified and kept, at
        most its `num_lookahead`, in order, each with its logprob and top alternatives; they
        come before `sampled_token_ids[i]` and their K/V was computed by the step (module
        docstring, lookahead). A token that ends the request drops those after it.
        """
        assert len(sampled_token_ids) == len(output.items), (
            f"{len(sampled_token_ids)} sampled tokens for {len(output.items)} items"
        )
        results: list[RequestOutput] = []
        for i, item in enumerate(output.items):
            token = sampled_token_ids[i]
            assert (token is not None) == item.samples, (item.request_id, item.samples, token)
            request = self.requests.get(item.request_id)
            if request is None:  # aborted between schedule() and update()
                continue
            assert request.num_computed_tokens == item.start_pos, (
                request.request_id,
                request.num_computed_tokens,
                item.start_pos,
            )
            kept = accepted[i] if accepted is not None else ()
            finished = False
            if kept:
                assert len(kept) <= item.num_lookahead, (request.request_id, len(kept), item)
                finished = self._append_accepted(request, kept)
            computed = request.num_computed_tokens = request.num_computed_tokens + len(
                item.token_ids
            )
            if min(computed // self.config.block_size, len(request.block_hashes)) > (
                request.num_registered_blocks
            ):  # a block became full: register it (the check inlined: every row, every step)
                self.register_full_blocks(request)
            if finished:
                self.finish_running(request)
                results.append(request.make_output())
                continue
            if token is None:
                continue
            finished = request.append_token(
                token,
                logprobs[i] if logprobs is not None else 0.0,
                top_logprobs[i] if top_logprobs is not None else None,
            )
            if finished:
                self.finish_running(request)
            else:
                request.update_block_hashes(self.config.block_size)
            results.append(request.make_output())
        return results

    def _append_accepted(self, request: Request, kept: Sequence[AcceptedToken]) -> bool:
        """Append a verified step's accepted proposals (their K/V is computed: they count as
        computed tokens); True when one of them ends the request."""
        for token, logprob, top in kept:
            request.num_computed_tokens += 1
            if request.append_token(token, logprob, top):
                return True
        request.update_block_hashes(self.config.block_size)
        return False

    def _grant_lookahead(self, request: Request, lookahead: Lookahead, budget: int) -> int:
        """Extra positions for the decoding `request`'s proposals this step (module
        docstring, lookahead): at most what it wants, its remaining tokens but one, the
        budget left, and what its blocks plus free blocks hold (no preemption)."""
        want = min(
            lookahead(request),
            request.params.max_tokens - request.num_output_tokens - 1,
            budget,
        )
        if want <= 0:
            return 0
        bs = self.config.block_size
        held = len(request.block_ids)
        need = _blocks_for(request.num_tokens + want, bs) - held
        if need > 0:
            new = self.block_pool.allocate(need)
            if new is None:
                return max(0, held * bs - request.num_tokens)
            request.block_ids.extend(new)
        return want

    def finish_running(self, request: Request) -> None:
        """The running `request` sampled its last token: it leaves the batch and its blocks
        are freed, unless an open send holds them until the transport's result."""
        self.running.remove(request)
        if not self.sends(request):  # else freed at its result
            self._release_blocks(request)
        del self.requests[request.request_id]

    # ------------------------------------------------------------------ helpers

    def _item(self, request: Request, n: int, lookahead: int = 0) -> ScheduledRequest:
        start = request.num_computed_tokens
        end = start + n
        assert n > 0 and end <= request.num_tokens, (request.request_id, start, n)
        return ScheduledRequest(
            request_id=request.request_id,
            token_ids=request.all_token_ids[start:end],
            start_pos=start,
            block_table=list(request.block_ids),
            samples=end == request.num_tokens,
            num_lookahead=lookahead,
        )

    def _ensure_blocks(
        self, request: Request, num_tokens: int, scheduled: set[str], preempted: list[str]
    ) -> bool:
        """Give `request` blocks for `num_tokens` positions, preempting the most recently
        admitted unscheduled requests as needed. False if `request` itself was preempted."""
        need = _blocks_for(num_tokens, self.config.block_size) - len(request.block_ids)
        while need > 0:
            new = self.block_pool.allocate(need)
            if new is not None:
                request.block_ids.extend(new)
                return True
            victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        assert not self.sends(request), (request.request_id, "preempted while sending")
        self.running.remove(request)
        self._release_blocks(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.waiting.appendleft(request)

    def _admit(self, request: Request, budget: int) -> int | None:
        """Try to admit the waiting `request` with `budget` tokens left: take its prefix-cache
        hits and blocks for all its tokens, mark it RUNNING. Returns the number of tokens to
        run this step, or None (nothing changed) if the budget or the free blocks fall short."""
        bs = self.config.block_size
        pool = self.block_pool
        # Never reuse the block holding the last token: it must run to produce logits.
        reusable = (request.num_tokens - 1) // bs
        hits = pool.lookup(request.block_hashes[:reusable])
        num_new = request.num_tokens - len(hits) * bs
        if not self.config.enable_chunked_prefill and num_new > budget:
            return None
        to_allocate = _blocks_for(request.num_tokens, bs) - len(hits)
        revived = sum(1 for b in hits if pool.ref_count(b) == 0)
        if to_allocate + revived > pool.num_free:
            return None
        pool.acquire(hits)
        new = pool.allocate(to_allocate)
        assert new is not None, (to_allocate, pool.num_free)
        request.block_ids = hits + new
        request.num_computed_tokens = len(hits) * bs
        request.num_registered_blocks = len(hits)
        if request.status is RequestStatus.WAITING:
            request.num_cached_tokens = len(hits) * bs
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return min(num_new, budget)

    def register_full_blocks(self, request: Request) -> None:
        """Register `request`'s computed full blocks not yet registered with the prefix cache."""
        full = min(request.num_computed_tokens // self.config.block_size, len(request.block_hashes))
        start = request.num_registered_blocks
        if full > start:
            self.block_pool.cache_blocks(
                request.block_ids[start:full], request.block_hashes[start:full]
            )
            request.num_registered_blocks = full

    def _release_blocks(self, request: Request) -> None:
        self.block_pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
        request.num_registered_blocks = 0

    def check_integrity(self) -> None:
        """Assert that queues, request states, reservations and pool ref counts agree (with
        the values): every allocated block is held by exactly the references counted here."""
        bs = self.config.block_size
        held: dict[int, int] = {}
        assert len(self.running) <= self.config.max_num_seqs, len(self.running)
        for rid, kv in self.remote.items():
            assert kv.block_ids and rid not in self.requests, (rid, kv)
            for b in kv.block_ids:
                held[b] = held.get(b, 0) + 1
        for tid, gone in self.abandoned.items():
            assert gone.transfer_id == tid and gone.block_ids, (tid, gone)
            for b in gone.block_ids:
                held[b] = held.get(b, 0) + 1
        for rid, send in self.sending.items():
            request = send.request
            assert request.request_id == rid, (rid, request.request_id)
            if self.requests.get(rid) is request:  # running: counted there
                assert request in self.running, (rid, request.status)
            else:  # finished: the send holds its blocks until the transport's result
                assert request.status is RequestStatus.FINISHED and request.block_ids, (
                    rid,
                    request.status,
                )
                for b in request.block_ids:
                    held[b] = held.get(b, 0) + 1
        for request in self.ready:
            assert request.block_ids, (request.request_id, "ready without blocks")
            assert request.status is RequestStatus.WAITING and request.is_decoding, (
                request.request_id,
                request.status,
                request.num_computed_tokens,
            )
            for b in request.block_ids:
                held[b] = held.get(b, 0) + 1
        for request in self.running:
            assert request.status is RequestStatus.RUNNING, (request.request_id, request.status)
            assert len(request.block_ids) * bs >= request.num_computed_tokens, (
                request.request_id,
                len(request.block_ids),
                request.num_computed_tokens,
            )
            for b in request.block_ids:
                held[b] = held.get(b, 0) + 1
        for request in self.waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED), (
                request.request_id,
                request.status,
            )
            assert not request.block_ids and request.num_computed_tokens == 0, (
                request.request_id,
                request.block_ids,
                request.num_computed_tokens,
            )
        ids = [r.request_id for r in [*self.running, *self.waiting, *self.ready]]
        assert sorted(ids) == sorted(self.requests), (ids, sorted(self.requests))
        pool = self.block_pool
        for b in range(pool.num_blocks):
            assert pool.ref_count(b) == held.get(b, 0), (
                f"block {b}: pool ref count {pool.ref_count(b)}, held by {held.get(b, 0)}"
            )
        pool.check_integrity()
