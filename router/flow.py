"""One admitted request's worker calls: disagg (Reserve -> Prefill -> Decode) or colocated,
and the move to another decode worker when one fails mid-stream.

Runs in the router process, inside the `Generate` handler's task. A *leg* (`Leg`) is one
placement of the request on workers; the first leg is the client's prompt. Steps (disagg):

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

Migration: when the decode (or colocated) worker's stream fails after tokens reached the
client (`WorkerLost`: the worker died, stopped, ended the stream early, or froze: silent for
`stall_timeout_s` and no answer to a status call), the request moves
— at most `max_migrations` times — to a new leg: prompt = the client's prompt + every token
already sent, max_tokens = what is left, `num_sampled` = the tokens already sampled (a seeded
generator skips their draws, so seeded sampling continues its stream); steps 0-4 run again
without the failed worker. The client sees one unbroken stream; greedy output is what an
undisturbed run gives (the new leg prefills exactly the tokens the old one had).

Every worker call has a timeout equal to the time left before the request's deadline. Whatever
ends the request early (stop string, error, deadline, client cancel), the caller aborts every
address left in `holders` (`RequestRun.holders`), from a task that outlives the handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from router.client_stream import ClientStream, RunTimings
from router.errors import Retryable, RouterError
from router.policy import Role, RouteRequest, RoutingDecision, RoutingPolicy, WorkerView
from router.pool import WorkerPool
from router.prefix_index.guard import GuardedPrefixIndex, PromptPrefix
from router.validation import ValidatedRequest
from router.worker_calls import Chunks, Leg, WorkerLost, reserve_and_prefill, start_colocated

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
    holders: set[str] = field(default_factory=set)
    excluded: set[str] = field(default_factory=set)  # workers that failed this request
    migrations: int = 0
    streaming_from: str = ""  # address of the worker whose stream the client is fed from
    placed_on: list[str] = field(default_factory=list)  # workers it was in flight on, in order
    _tracking: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)

    @property
    def timings(self) -> RunTimings:
        return self.client.timings

    @property
    def completion_tokens(self) -> int:
        """Tokens sent to the client so far."""
        return len(self.client.tokens)

    def remaining(self) -> float:
        """Seconds left before the deadline; raises DEADLINE_EXCEEDED when none are."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "request deadline passed")
        return left

    def track(self, address: str) -> None:
        """Count this request as in flight on `address` until the leg ends (`close`); it
        joins `placed_on`."""
        self._tracking.enter_context(self.pool.track(address))
        self.note_placed(address)

    def note_placed(self, address: str) -> None:
        """Remember that this request was sent to `address` (`placed_on`, first time only)."""
        if address not in self.placed_on:
            self.placed_on.append(address)

    def close(self) -> None:
        """Drop this request's in-flight counts on its workers (at the end of a leg and of the
        request, whatever happened)."""
        self._tracking.close()

    async def execute(self) -> None:
        """Run the request to its final message; raise `RouterError` on failure."""
        chunks = await self._place(Leg(self.req.prompt_token_ids, self.req.sampling.max_tokens))
        while True:
            try:
                async with contextlib.aclosing(chunks):  # closing cancels the worker call
                    async for chunk in chunks:
                        if await self.client.push(
                            chunk.token_ids, chunk.finished, chunk.finish_reason, chunk.logprobs
                        ):
                            return
                lost = f"the stream of worker {self.streaming_from} ended without finishing"
                raise WorkerLost(self.streaming_from, lost)
            except WorkerLost as lost:
                chunks = await self._migrate(lost)

    async def _migrate(self, lost: WorkerLost) -> Chunks:
        """Move the request off the worker that failed mid-stream (see the module docstring)."""
        left = self.req.sampling.max_tokens - len(self.client.tokens)
        if self.migrations >= self.max_migrations or left <= 0:
            raise RouterError(grpc.StatusCode.UNAVAILABLE, lost.message, lost.public)
        self.migrations += 1
        self.client.facts.migrations = self.migrations
        self.excluded.add(lost.address)
        if lost.address in self.holders:
            self.holders.discard(lost.address)
            self.abort_later(self.request_id, [lost.address])
        self.close()  # no longer in flight on the failed worker
        sent = self.client.tokens
        log.warning(
            "request %s: %s after %d tokens; moving it to another worker (migration %d of %d)",
            self.request_id,
            lost.message,
            len(sent),
            self.migrations,
            self.max_migrations,
        )
        leg = Leg(self.req.prompt_token_ids + tuple(sent), left, num_sampled=len(sent))
        try:
            return await self._place(leg)
        except RouterError as exc:
            why = f"{lost.message}; moving the request failed: {exc.message}"
            public = f"{lost.public}; moving the request failed: {exc.public}"
            raise RouterError(exc.code, why, public) from exc

    # -- routing and the first token -------------------------------------------------------

    async def _place(self, leg: Leg) -> Chunks:
        """Route `leg` and start it, retrying elsewhere while nothing of it reached the client;
        return its chunk stream, whose first chunk (the leg's first token) is already known."""
        last: Retryable | None = None
        prefix = await self._prefix_lookup(leg)
        for _ in range(self.max_attempts):
            decision = self._choose(leg, last, prefix)
            try:
                if decision.colocated is not None:
                    return await start_colocated(self, leg, decision.colocated)
                assert decision.prefill is not None and decision.decode is not None
                return await reserve_and_prefill(
                    self, leg, decision.prefill, decision.decode, decision.cached_tokens
                )
            except Retryable as exc:
                last = exc
                self.excluded.add(exc.address)
                self.close()
                if self.holders:  # nothing reached the client: undo, then try elsewhere
                    holders, self.holders = sorted(self.holders), set()
                    # the failed worker is not tried again here: no need to wait for it
                    self.abort_later(self.request_id, [a for a in holders if a in self.excluded])
                    await self.abort_now(
                        self.request_id, [a for a in holders if a not in self.excluded]
                    )
        assert last is not None
        raise RouterError(last.code, last.message, last.public)

    async def _prefix_lookup(self, leg: Leg) -> PromptPrefix:
        """The prompt's chain and the index's matches (block size: the workers', if they agree;
        else, without an index, or for a policy that ignores prefixes: none, by load only)."""
        if self.prefix_index is None or not self.policy.uses_prefix_matches:
            return PromptPrefix()
        role: Role = "colocated" if self.colocated else "prefill"
        sizes = {v.block_size for v in self.pool.views(role) if v.healthy}
        if len(sizes) != 1:
            return PromptPrefix()
        return await self.prefix_index.lookup_prompt(leg.prompt, sizes.pop())

    def _choose(self, leg: Leg, last: Retryable | None, prefix: PromptPrefix) -> RoutingDecision:
        def views(role: str) -> list[WorkerView]:
            return [
                v for v in self.pool.views() if v.role == role and v.address not in self.excluded
            ]

        route = RouteRequest(
            self.request_id,
            len(leg.prompt),
            leg.max_tokens,
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
