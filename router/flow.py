"""One admitted request's worker calls: disagg (Reserve -> Prefill -> Decode) or colocated,
and the move to another decode worker when one fails mid-stream.

Runs in the router process, inside the `Generate` handler's task. A `RequestRun` is the one
owner of a request's router-side state: it owns its legs (`leg.Leg`: one attempt to
place the request on workers, with that attempt's holders, in-flight counts and measurements)
and reads them; the client's stream and final facts are written only here. The first leg's
prompt is the client's. Steps (disagg):

0. the leg's prompt's block-hash chain is looked up in the prefix index (one round trip,
   bounded by the index's lookup timeout; no answer means "route by load only"), unless the
   policy ignores prefixes (`RoutingPolicy.uses_prefix_matches`);
1. the policy picks (P, D) from the pool's views, minus workers that already failed this
   request (`RequestRun.excluded`);
2. `Reserve` on D -> ticket (D joins `holders` before the call: it may hold blocks before its
   answer arrives);
3. `Prefill` on P with the ticket (P joins `holders` while it runs) -> first token, sent to the
   client at once; a failure here, before anything was sent, aborts the holders and retries on
   other workers (up to `max_route_attempts`), avoiding the worker at fault: the one called,
   or the KV peer its answer names (a Prefill whose push to a dead D failed blames D);
4. `Decode` stream on D -> token chunks -> text deltas (stop strings end the request early);
5. the final message carries finish reason, usage, timings and the number of migrations.

Frozen workers (`router.freeze_watch`): every call of a leg runs under a watch on the workers
it waits on (Reserve: D; Prefill: P and D, its KV push's target; Decode / Generate: the worker
streaming); a watched worker silent for `stall_timeout_s` that does not answer a status call
ends the call as a dead worker's failure would — a retry without it before anything reached
the client (step 3's rule), a migration after — so no phase waits out the request's deadline
on a frozen worker.

Migration: when the decode (or colocated) worker's stream fails after tokens reached the
client (`WorkerLost`: the worker died, stopped, ended the stream early, or froze: silent for
`stall_timeout_s` and no answer to a status call), the request moves
— at most `max_migrations` times — to a new leg: prompt = the client's prompt + every token
already sent, max_tokens = what is left, `num_sampled` = the tokens already sampled (a seeded
generator skips their draws, so seeded sampling continues its stream); steps 0-4 run again
without the failed worker. The client sees one unbroken stream; in float32 its greedy output is
exactly what an undisturbed run gives (the new leg prefills exactly the tokens the old one had,
and the prefill's logits are bit-identical to the decode steps'); in bfloat16 it is equal up to
the first bf16 near-tie, where the two paths' rounding may flip the argmax.

Every worker call has a timeout equal to the time left before the request's deadline. Whatever
ends the request early (stop string, error, deadline, client cancel), the caller aborts every
address left in `holders` (`RequestRun.holders`), from a task that outlives the handler.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from router.client_stream import ClientStream, RunTimings
from router.errors import Retryable, RouterError
from router.hybrid import HybridConfig, PathChoice, choose_prefill_path, indexed_tokens
from router.leg import Chunks, Leg, LegSpec, WorkerLost
from router.policy import Role, RouteRequest, RoutingDecision, RoutingPolicy, WorkerView
from router.pool import WorkerPool
from router.prefix_index.guard import GuardedPrefixIndex, PromptPrefix
from router.prefix_policy import load_tokens
from router.validation import ValidatedRequest
from tracing.spans import NO_SPAN, Attributes, Span

__all__ = ["RequestRun", "RunTimings"]

log = logging.getLogger(__name__)


@dataclass
class RequestRun:
    """State of one request while its worker calls run. Create one per admitted request."""

    request_id: str
    req: ValidatedRequest
    deadline: float  # loop.time() by which everything must be over
    pool: WorkerPool
    policy: RoutingPolicy
    colocated: bool
    max_attempts: int
    abort_now: Callable[[str, Sequence[str]], Awaitable[None]]
    abort_later: Callable[[str, Sequence[str]], None]
    client: ClientStream
    max_migrations: int = 0
    stall_timeout_s: float = 3.0  # a worker stream silent this long: is its worker frozen?
    prefix_index: GuardedPrefixIndex | None = None
    hybrid: HybridConfig | None = None  # conditional disaggregation (`router.hybrid`); None: off
    span: Span = NO_SPAN  # the request's root span (`router.request_trace`): legs go under it
    excluded: set[str] = field(default_factory=set)  # workers that failed this request
    migrations: int = 0
    legs: list[Leg] = field(default_factory=list)  # every attempt so far, in order
    _first: Leg | None = None  # the leg that first streamed: its timings are reported
    _parent: Span = NO_SPAN  # where a new leg's spans go: the root, or the latest migration

    @property
    def timings(self) -> RunTimings:
        return self.client.timings

    @property
    def completion_tokens(self) -> int:
        """Tokens sent to the client so far."""
        return len(self.client.tokens)

    @property
    def holders(self) -> set[str]:
        """Every worker that may still hold this request (any leg's): each gets an Abort when
        the request ends early."""
        return set().union(*(leg.holders for leg in self.legs))

    @property
    def placed_on(self) -> list[str]:
        """Every worker the request was sent to, in order, each once (all legs)."""
        return list(dict.fromkeys(a for leg in self.legs for a in leg.placed))

    def close(self) -> None:
        """Drop this request's in-flight counts on its workers (at the end of a leg and of the
        request, whatever happened); end the latest migration's span."""
        for leg in self.legs:
            leg.close()
        if self._parent is not self.span:
            self._parent.end()

    async def execute(self) -> None:
        """Run the request to its final message; raise `RouterError` on failure."""
        self._parent = self.span
        spec = LegSpec(self.req.prompt_token_ids, self.req.sampling.max_tokens)
        leg, chunks = await self._place(spec)
        self._first = leg
        while True:
            try:
                async with contextlib.aclosing(chunks):  # closing cancels the worker call
                    async for chunk in chunks:
                        self._report(leg)
                        if await self.client.push(
                            chunk.token_ids, chunk.finished, chunk.finish_reason, chunk.logprobs
                        ):
                            return
                lost = f"the stream of worker {leg.streaming_from} ended without finishing"
                raise WorkerLost(leg.streaming_from, lost)
            except WorkerLost as lost:
                leg, chunks = await self._migrate(leg, lost)

    def _report(self, leg: Leg) -> None:
        """What the final message says of the workers: the streaming leg's workers, the first
        leg's timings and cached tokens (a migrated leg's are not the client's)."""
        facts, report = self.client.facts, leg.report
        facts.prefill_worker, facts.decode_worker = report.prefill_worker, report.decode_worker
        if leg is self._first:
            t = self.client.timings
            t.prefill_queue_ms, t.prefill_compute_ms = (
                report.prefill_queue_ms,
                report.prefill_compute_ms,
            )
            t.kv_transfer_ms = report.kv_transfer_ms
            t.decode_admission_ms = report.decode_admission_ms
            t.first_decode_step_ms = report.first_decode_step_ms
            facts.cached_tokens = report.cached_tokens
            facts.prefill_path, facts.prefill_path_reason = report.prefill_path, report.path_reason

    async def _migrate(self, leg: Leg, lost: WorkerLost) -> tuple[Leg, Chunks]:
        """Move the request off the worker that failed mid-stream (see the module docstring)."""
        left = self.req.sampling.max_tokens - len(self.client.tokens)
        if self.migrations >= self.max_migrations or left <= 0:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, lost.message, lost.public)
        self.migrations += 1
        self.client.facts.migrations = self.migrations
        self.excluded.add(lost.address)
        self._migration_span(lost)
        if leg.release(lost.address):
            self.abort_later(self.request_id, [lost.address])
        leg.close()  # no longer in flight on the failed worker
        sent = self.client.tokens
        log.warning(
            "request %s: %s after %d tokens; moving it to another worker (migration %d of %d)",
            self.request_id,
            lost.message,
            len(sent),
            self.migrations,
            self.max_migrations,
        )
        spec = LegSpec(self.req.prompt_token_ids + tuple(sent), left, num_sampled=len(sent))
        try:
            return await self._place(spec)
        except RouterError as exc:
            why = f"{lost.message}; moving the request failed: {exc.message}"
            public = f"{lost.public}; moving the request failed: {exc.public}"
            raise RouterError(exc.code, why, public) from exc

    def _migration_span(self, lost: WorkerLost) -> None:
        """A ``pdserve.migration`` span from now to the end of the new leg (the next migration
        or the request's end); the new leg's calls are its children."""
        if self._parent is not self.span:
            self._parent.end()  # the previous migration's leg ended here
        attrs: Attributes | None = (
            {
                "pdserve.migration": self.migrations,
                "pdserve.migration.from": lost.address,
                "pdserve.migration.reason": lost.message,
                "pdserve.migration.tokens_sent": len(self.client.tokens),
            }
            if self.span.recording
            else None
        )
        self._parent = self.span.child("pdserve.migration", attributes=attrs)

    # -- routing and the first token -------------------------------------------------------

    async def _place(self, spec: LegSpec) -> tuple[Leg, Chunks]:
        """Route a leg asking `spec` and start it, retrying elsewhere (a new leg per attempt)
        while nothing of it reached the client; return the leg and its chunk stream, whose
        first chunk (the leg's first token) is already known."""
        last: Retryable | None = None
        prefix = await self._prefix_lookup(spec)
        for attempt in range(self.max_attempts):
            decision = self._choose(spec, last, prefix)
            leg = Leg(
                self.request_id,
                spec,
                self.req,
                self.pool,
                self.deadline,
                self.stall_timeout_s,
                self._parent,
            )
            self.legs.append(leg)
            try:
                if decision.colocated is not None:
                    return leg, await leg.start_colocated(decision.colocated)
                assert decision.prefill is not None and decision.decode is not None
                choice = self._prefill_path(spec, decision, prefix)
                leg.take_path(choice)
                if choice.path == "local":  # Generate on D: it prefills, then decodes
                    # the prompt's blocks land on D: the policy's cache credit goes there
                    self.policy.prefilled_elsewhere(self.request_id, decision.decode)
                    cached = len(spec.prompt) - choice.uncached_tokens
                    return leg, await leg.start_colocated(decision.decode, cached)
                chunks = await leg.reserve_and_prefill(
                    decision.prefill, decision.decode, decision.cached_tokens
                )
                return leg, chunks
            except Retryable as exc:
                last = exc
                log.warning(
                    "request %s: %s; trying workers without %s (attempt %d of %d)",
                    self.request_id,
                    exc.message,
                    exc.address,
                    attempt + 1,
                    self.max_attempts,
                )
                self.excluded.add(exc.address)
                leg.close()
                holders = leg.give_up()
                if holders:  # nothing reached the client: undo, then try elsewhere
                    # the failed worker is not tried again here: no need to wait for it
                    self.abort_later(self.request_id, [a for a in holders if a in self.excluded])
                    await self.abort_now(
                        self.request_id, [a for a in holders if a not in self.excluded]
                    )
        assert last is not None
        raise RouterError(last.code, last.message, last.public)

    def _prefill_path(
        self, spec: LegSpec, decision: RoutingDecision, prefix: PromptPrefix
    ) -> PathChoice:
        """`router.hybrid.choose_prefill_path` for the policy's (P, D) pair: the prompt's
        uncached tokens on each (prefix index), both workers' queued prefill tokens, and the
        requests on D (its polled running count, or this router's requests there if more)."""
        p, d = decision.prefill, decision.decode
        assert p is not None and d is not None, decision
        n = len(spec.prompt)
        on_d = indexed_tokens(
            d.worker_id, d.epoch, d.block_size, len(prefix.block_hashes), prefix.matches, n
        )
        return choose_prefill_path(
            self.hybrid or HybridConfig(),
            n,
            cached_on_decode=on_d,
            cached_on_prefill=decision.cached_tokens,
            prefill_queued_tokens=load_tokens(p),
            decode_queued_tokens=load_tokens(d),
            decode_running=max(d.num_running, d.in_flight),
        )

    async def _prefix_lookup(self, spec: LegSpec) -> PromptPrefix:
        """The prompt's chain and the index's matches (block size: the workers', if they agree;
        else, without an index, or for a policy that ignores prefixes and no hybrid path to
        price: none, by load only)."""
        wanted = self.policy.uses_prefix_matches or (
            self.hybrid is not None and self.hybrid.enabled
        )
        if self.prefix_index is None or not wanted:
            return PromptPrefix()
        role: Role = "colocated" if self.colocated else "prefill"
        sizes = {v.block_size for v in self.pool.views(role) if v.healthy}
        if len(sizes) != 1:
            return PromptPrefix()
        with self._parent.child("pdserve.prefix_lookup") as span:
            found = await self.prefix_index.lookup_prompt(spec.prompt, sizes.pop())
            if span.recording:
                span.set({"pdserve.prefix.blocks": len(found.block_hashes)})
            return found

    def _choose(
        self, spec: LegSpec, last: Retryable | None, prefix: PromptPrefix
    ) -> RoutingDecision:
        def views(role: str) -> list[WorkerView]:
            return [
                v for v in self.pool.views() if v.role == role and v.address not in self.excluded
            ]

        route = RouteRequest(
            self.request_id,
            len(spec.prompt),
            spec.max_tokens,
            self.colocated,
            block_hashes=prefix.block_hashes,
            prefix_matches=prefix.matches,
        )
        if self.colocated:
            roles: tuple[str, ...] = ("colocated",)
            decision = self.policy.choose(route, views("colocated"), [])
        else:
            roles = ("prefill", "decode")
            decision = self.policy.choose(route, views("prefill"), views("decode"))
        if decision is not None:
            return decision
        if last is not None:
            raise RouterError(last.code, last.message, last.public)
        for role in roles:
            if not any(v.usable for v in views(role)):
                why = "; ".join(v.why_unusable() for v in views(role)) or "none left to try"
                raise RouterError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"no healthy {role} worker ({why})",
                    f"no healthy {role} worker",
                )
        raise RouterError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"no worker has KV room for {route.total_tokens} tokens now",
        )
