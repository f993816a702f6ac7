"""Discrete-event simulator of a pdserve cluster (the planner's and the controller's model).

Pure Python, deterministic; runs in `pdserve plan`, `pdserve plan --validate`,
`pdserve simulate` and the benchmarks. Every worker runs the engine's REAL scheduler
(`model_runtime.scheduler.Scheduler` and its `BlockPool`, through `sim_engine.SimEngine`) on
virtual time: admission, chunked prefill, preemption, block accounting and the prefix cache are
the engine's own code. The simulator only decides *when*: a step's duration is the cost
model's price of the batch the scheduler composed (`costs.CostModel.step_s`), and the router,
the KV hand-offs and the shared CPU are modelled around it:

- **router**: at most `max_inflight` requests run (FIFO queue beyond, `max_queued` long; a
  request that finds it full fails at once). Each request is routed on arrival by the router's
  real policy code (`sim_routing`; `policy` names it, default `least_load`) on views read from
  the workers' schedulers: colocated, to the worker it picks; disaggregated, to the (prefill,
  decode) pair the `router` seam picks (default: the same policy). No pair or worker with
  room: the request fails, as RESOURCE_EXHAUSTED;
- **hybrid** (`ClusterSpec.hybrid_threshold`): after the pair is picked, `choose(uncached
  prompt tokens on the decode worker, the prefill worker's queued prompt tokens, the decode
  worker's, its running requests)` (`sim_routing.Choose`, default `threshold_rule`) sends the
  request either
  "local" — it enters the decode worker's scheduler as a new request and prefills there,
  chunked inside its decode batches, and the policy that picked the pair is told
  (`prefilled_elsewhere`, as `router.flow` does: `prefix_aware` moves its pending cache credit
  to the decode worker) — or "remote", as below;
- **remote path**: the decode worker's hand-off owner reserves the request's blocks
  (`KVHandoff.reserve`, prompt + output - 1 tokens; none free: it fails) and the prefill
  worker's scheduler runs the prompt as a one-token request whose send opens in the step that
  samples its first token (`KVHandoff.open_send`), so it keeps its blocks when it finishes.
  The KV hand-off then takes `transfer_s` (the router seam's, or `handoff`); when it lands
  (`SimEngine.land`: each side's `KVHandoff.poll`) the prefill worker's blocks are freed, the
  decode worker's reservation is RECEIVED and becomes a prefilled request (`KVHandoff.admit`),
  and the client has its first token `cost.ttft_overhead` after the sampling;
- **steps**: a worker with work runs one engine step at a time: `schedule()`, the step's
  price on the shared CPU, then `update()`. A request's first sampled token reaches the client
  `cost.ttft_overhead` later (TTFT); TPOT is first token to last over output - 1 tokens;
- **CPU sharing**: with `cores` set, every worker's step keeps `threads` cores busy, and the
  busy entities share the cores equally (processor sharing: each advances at
  min(1, cores / busy threads) of full speed). CPU spent beside the steps runs on "side"
  entities that share the cores the same way: one per worker (its gRPC / transport threads:
  `cost.prefill_request_s` per prompt plus `cost.prefill_kv_token_cpu_s` per prompt token
  whose KV it sends, `cost.decode_token_cpu_s` per token plus `cost.decode_kv_token_cpu_s`
  per prompt token whose KV it receives) and one for the
  router + client ("host": `cost.host_request_s` per request, `cost.host_token_s` per token).
  A step of a multi-thread worker turns only `cost.contended_eff(...)` of its share into
  progress while the cores are oversubscribed (`sim_cpu`). With `cores=None` each worker has
  its own device and side work is not modelled.
- **role switches** (`switch`): a worker drains — no new work, finishes what it holds — then
  comes back in its new role `role_switch_s` later with an empty cache; past
  `drain_timeout_s` what it still holds is aborted (those requests fail), as `SetRole` does.

`simulate(requests, spec, cost)` returns one `SimOutcome` per request (same order), with the
client's TTFT and TPOT, the goodput-bench way.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

from tooling.planner.costs import CostModel
from tooling.planner.sim_cpu import SharedCpu
from tooling.planner.sim_engine import SimEngine, Step
from tooling.planner.sim_routing import (
    ROUTE_ID,
    Choose,
    Pick,
    PolicyRouter,
    Router,
    colocated_pick,
    policy_router,
    sim_policy,
    threshold_rule,
    view,
)
from tooling.planner.sim_types import ClusterSpec, SimOutcome, SimRequest, attainment
from tooling.planner.sim_workers import Entity, Job, Route, Worker
from worker.kv_handoff import Outcome

__all__ = [
    "ClusterSpec",
    "Pick",
    "Router",
    "Sim",
    "SimOutcome",
    "SimRequest",
    "attainment",
    "charged",
    "simulate",
]

FIRST, TICK, FLIP, ABORT = 0, 1, 2, 3  # timer kinds


class Sim:
    """The model of the module docstring. Workers keep their identity (`index`) across role
    switches. `run()` runs to the end; `run_until(t)` stops at `t` (and right after a role
    flip, so a controller sees it when it happens); `on_tick(sim)` runs every `tick_s`.
    `on_step(worker, step)` (tests, tracing) sees every step the workers' schedulers compose,
    when it starts (every step is then a real one: no decode clock). `fast=False`: no decode
    clock either (`sim_engine`; the results are the same)."""

    def __init__(
        self,
        reqs: Sequence[SimRequest],
        spec: ClusterSpec,
        cost: CostModel,
        router: Router | None = None,
        drain_timeout_s: float = math.inf,
        choose: Choose | None = None,
        policy: str = "least_load",
        fast: bool = True,
    ) -> None:
        self.reqs, self.spec, self.cost = reqs, spec, cost
        # the decode clock (`sim_engine`): the same simulation, without a pass over every row
        # at each decode step; off, or with `on_step` set, every step is a real one
        self.fast = fast
        self.now = 0.0
        # the router's policy by name (`sim_policy`): colocated picks, and the pairs unless
        # `router` is given
        self.policy = sim_policy(policy, lambda: self.now)
        self.router: Router = router or policy_router(self.policy)
        # the policy that chose the pair, told of a local prefill (None: a custom router)
        self.pair_policy = self.router.policy if isinstance(self.router, PolicyRouter) else None
        threshold = spec.hybrid_threshold
        self.choose: Choose | None = choose or (
            None if threshold is None else threshold_rule(threshold)
        )
        self.drain_timeout_s = drain_timeout_s
        self.out = [SimOutcome(input_len=r.input_len) for r in reqs]
        kinds = ["prefill"] * spec.prefill + ["decode"] * spec.decode
        kinds += ["colocated"] * spec.colocated
        nodes = spec.nodes or ("",) * len(kinds)
        self.workers = [
            Worker(k, i, spec.threads, node=nodes[i], engine=self._engine())
            for i, k in enumerate(kinds)
        ]
        self.host = Entity("host", -1)
        self.sides = [Entity("side", w.index) for w in self.workers]
        self.timers: list[tuple[float, int, int, object]] = []
        self.on_tick: Callable[[Sim], None] | None = None
        self.tick_s = 0.0
        self.on_end: Callable[[int, SimOutcome], None] | None = None
        self.on_step: Callable[[Worker, Step], None] | None = None
        # KV hand-off delay, decided when the prompt's first token is sampled (default: the
        # router's `transfer_s`); `pairing.Links` models links that requests share
        self.handoff: Callable[[Sim, Job], float] | None = None
        self.flipped: list[Worker] = []  # flips since the caller last cleared it
        # core-seconds of model steps per worker kind: a step of `work` s on `threads` cores
        self.step_core_s = {"prefill": 0.0, "decode": 0.0, "colocated": 0.0}
        self.routes = {r: 0 for r in Route}  # requests served each way
        self.tokens = 0  # generated tokens, first tokens included
        self.seq = 0
        self.inflight = 0
        self.router_q: deque[int] = deque()
        self.cpu = SharedCpu(spec.cores)
        self.ready: set[Worker] = set(self.workers)
        self.aborted = 0  # drains that timed out
        self.order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, i))
        self.next_arrival = 0
        self.ticking = False

    def _engine(self) -> SimEngine:
        s = self.spec
        return SimEngine(
            s.num_kv_blocks,
            s.block_size,
            s.chunk_tokens,
            s.max_num_seqs,
            s.chunked,
            s.prefix_caching,
        )

    # ---- roles -----------------------------------------------------------------------------

    def role(self, kind: str) -> list[Worker]:
        """Workers of `kind` that take new work (not draining)."""
        return [w for w in self.workers if w.kind == kind and not w.drain_to]

    def switch(self, w: Worker, role: str, drain_timeout_s: float | None = None) -> None:
        """Start draining `w` to `role` (module docstring, "role switches"); what it still
        holds after `drain_timeout_s` (default: the simulator's) is aborted."""
        assert role in ("prefill", "decode") and role != w.kind and not w.drain_to, (w, role)
        w.drain_to = role
        self.ready.add(w)
        timeout = self.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if math.isfinite(timeout):
            w.drains += 1
            self.timer(self.now + timeout, ABORT, (w, w.drains))
        self._check_drained(w)

    def _check_drained(self, w: Worker) -> None:
        if not w.drain_to or w.flipping or not w.idle():
            return
        w.flipping = True
        self.timer(self.now + self.spec.role_switch_s, FLIP, w)

    def _flip(self, w: Worker) -> None:
        w.kind, w.drain_to, w.flipping = w.drain_to, "", False
        w.engine = self._engine()
        w.drains += 1  # an abort timer of this drain no longer applies
        self.flipped.append(w)
        self.ready.add(w)

    def _abort_drain(self, w: Worker) -> None:
        """The drain timed out: what `w` still holds fails (SetRole aborts it)."""
        if not w.drain_to or w.flipping:
            return
        self.aborted += 1
        for job in list(w.jobs.values()):
            self.fail(job)
        self.cpu.cancel(w)
        if w.step is not None:
            w.eng.abandon(w.step)
        w.step = None
        self._check_drained(w)

    # ---- the shared CPU ----------------------------------------------------------------------

    def host_work(self, seconds: float, worker: Worker | None = None) -> None:
        """Queue CPU work beside the steps: on `worker`'s side threads, or the host's."""
        if self.spec.cores is not None and seconds > 0:
            self.cpu.busy(self.host if worker is None else self.sides[worker.index], seconds, 1.0)

    # ---- router ----------------------------------------------------------------------------

    def arrive(self, i: int) -> None:
        if self.inflight >= self.spec.max_inflight:
            if self.spec.max_queued is not None and len(self.router_q) >= self.spec.max_queued:
                self._reject(i)  # the admission queue is full: RESOURCE_EXHAUSTED at once
                return
            self.router_q.append(i)
            return
        self.route(i)

    def route(self, i: int) -> None:
        r = self.reqs[i]
        if self.spec.colocated:
            w = colocated_pick(self.policy, self.spec, r, self.role("colocated"))
            if w is None:
                self._reject(i)
                return
            self._start(Job(i, r, w, Route.COLOCATED))
            return
        pick = self.router(self, r, self.role("prefill"), self.role("decode"))
        if pick is None:
            self._reject(i)
            return
        p, d, transfer_s = pick
        job = Job(i, r, d, Route.REMOTE, prefill=p, transfer_s=transfer_s)
        if self.choose is not None:
            prompt = job.prompt
            uncached = r.input_len - d.eng.cached_tokens(prompt, job.seed)
            loads = (p.eng.queued_tokens(), d.eng.queued_tokens(), d.eng.num_running)
            if self.choose(uncached, *loads) == "local":
                job = Job(i, r, d, Route.LOCAL)
                if self.pair_policy is not None:  # as `router.flow` does: the prompt's
                    # blocks land on the decode worker, and so does the policy's cache credit
                    self.pair_policy.prefilled_elsewhere(ROUTE_ID, view(d, self.spec))
        self._start(job)

    def _start(self, job: Job) -> None:
        """Hand `job` to its worker(s)' schedulers; fails it when they cannot take it."""
        r, d = job.req, job.decode
        try:
            if job.route is Route.REMOTE:
                p = job.prefill
                assert p is not None
                ticket = d.eng.reserve(job.rid, r.input_len, r.output_len)
                if ticket is None:
                    self._reject(job.idx)  # the decode worker's Reserve: RESOURCE_EXHAUSTED
                    return
                job.transfer_id = ticket.transfer_id
                d.jobs[job.rid] = job
                p.eng.add(job.rid, job.prompt, 1, ticket=ticket, seed=job.seed)
                p.jobs[job.rid] = job
                self.ready.add(p)
            else:
                d.eng.add(job.rid, job.prompt, r.output_len, seed=job.seed)
                d.jobs[job.rid] = job
                self.ready.add(d)
        except ValueError:  # can never run there (e.g. whole prompts above the budget)
            for w in (job.prefill, d):
                if w is not None and w.jobs.pop(job.rid, None) is not None:
                    w.eng.drop(job.rid)
            self._reject(job.idx)
            return
        self.routes[job.route] += 1
        self.out[job.idx].path = job.route.value
        self.inflight += 1
        self.host_work(self.cost.host_request_s)

    def _reject(self, i: int) -> None:
        self.out[i] = SimOutcome(ok=False, end_s=self.now, input_len=self.out[i].input_len)
        if self.on_end is not None:
            self.on_end(i, self.out[i])

    def end(self, job: Job, ok: bool, t: float | None = None) -> None:
        """`job` ended (all tokens, or failed) at `t` (default now): admit from the router
        queue. Its workers' schedulers freed (or are told to free) its blocks."""
        if job.ended:
            return
        job.ended = True
        for w in (job.prefill, job.decode):
            if w is not None and w.jobs.pop(job.rid, None) is not None:
                self.ready.add(w)
                self._check_drained(w)
        self.inflight -= 1
        o = self.out[job.idx]
        o.ok = ok
        o.end_s = self.now if t is None else t
        if self.on_end is not None:
            self.on_end(job.idx, o)
        while self.router_q and self.inflight < self.spec.max_inflight:
            self.route(self.router_q.popleft())

    def fail(self, job: Job) -> None:
        """Abort `job` wherever it is (a drain that timed out)."""
        for w in (job.prefill, job.decode):
            if w is not None and job.rid in w.jobs:
                w.eng.drop(job.rid)
        self.end(job, ok=False)

    # ---- steps -----------------------------------------------------------------------------

    def start_step(self, w: Worker) -> None:
        step = w.eng.step(self.fast and self.on_step is None)
        if step is None:
            return
        b = step.batch
        if w.kind == "prefill":
            work = self.cost.prefill_s(b.chunks)
        else:
            work = self.cost.step_s(b.chunks, b.decode, b.context)
        w.step = step
        if self.on_step is not None:
            self.on_step(w, step)
        self.step_core_s[w.kind] += work * w.threads
        eff = self.cost.contended_eff(b.chunks, b.decode, b.context) if w.threads > 1 else 1.0
        self.cpu.busy(w, work, w.threads, eff)

    def finish_step(self, w: Worker) -> None:
        step, w.step = w.step, None
        assert step is not None
        progress, made = w.eng.finish(step)  # `made`: rows that only got a token
        for prog in progress:
            job = w.jobs.get(prog.request_id)
            if job is None or not prog.new_tokens:
                continue
            if w.kind == "prefill":
                self._prefilled(w, job)
                continue
            first = job.first_s is None
            made += prog.new_tokens - first  # a first token is counted by `_first`
            if first:
                self._first(job, self.now + max(0.0, self.cost.ttft_overhead(job.req.input_len)))
            if prog.finished:
                o = self.out[job.idx]
                if job.req.output_len > 1 and job.first_s is not None:
                    o.tpot_s = (self.now - job.first_s) / (job.req.output_len - 1)
                self.end(job, ok=True, t=job.first_s if first else self.now)
        if made:
            self.tokens += made
            self.host_work(self.cost.host_token_s * made)
            self.host_work(self.cost.decode_token_cpu_s * made, w)
        self._check_drained(w)
        self.ready.add(w)

    def _prefilled(self, p: Worker, job: Job) -> None:
        """The prefill worker sampled `job`'s first token: its KV hand-off starts."""
        n = job.req.input_len
        self.host_work(self.cost.prefill_request_s + self.cost.prefill_kv_token_cpu_s * n, p)
        moved = job.transfer_s if self.handoff is None else self.handoff(self, job)
        over = max(0.0, self.cost.ttft_overhead(job.req.input_len))
        self.timer(self.now + max(0.0, moved) + over, FIRST, job)

    def _first(self, job: Job, t: float) -> None:
        """The client has `job`'s first token at `t` (set now; counted in `tokens`)."""
        job.first_s = t
        self.tokens += 1
        self.host_work(self.cost.host_token_s)
        self.out[job.idx].ttft_s = t - job.req.arrival_s

    def first_token(self, job: Job) -> None:
        """Remote path: the KV landed and the first token reached the client; the prefill
        worker frees its blocks and the decode worker admits the request."""
        if job.ended:
            return
        p, d = job.prefill, job.decode
        assert p is not None
        (sent,) = p.eng.land(job.transfer_id)  # the send's blocks are freed
        assert sent.outcome is Outcome.SENT, sent
        p.jobs.pop(job.rid, None)
        self.ready.add(p)
        self._check_drained(p)
        (received,) = d.eng.land(job.transfer_id)  # the reservation is RECEIVED
        assert received.outcome is Outcome.RECEIVED, received
        finished = d.eng.admit(job.rid, job.prompt, job.req.output_len, job.seed)
        self.host_work(self.cost.decode_kv_token_cpu_s * job.req.input_len, d)  # KV received
        self._first(job, self.now)
        if finished:
            self.end(job, ok=True)
        else:
            self.ready.add(d)

    def timer(self, t: float, kind: int, payload: object) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (t, self.seq, kind, payload))

    # ---- the event loop --------------------------------------------------------------------

    def _start_ready(self) -> None:
        for w in sorted(self.ready, key=lambda x: x.index):
            if w.step is None and not w.flipping and w.has_work():
                self.start_step(w)
        self.ready.clear()

    def done(self) -> bool:
        """Every request has arrived and ended, and nothing is in progress."""
        return (
            self.next_arrival >= len(self.order)
            and self.inflight == 0
            and not self.router_q
            and not any(k != TICK for _, _, k, _ in self.timers)
        )

    def run_until(self, t_stop: float) -> bool:
        """Process every event up to `t_stop` (stopping early right after a role flip);
        True once `done()`."""
        if self.on_tick is not None and self.tick_s > 0 and not self.ticking:
            self.ticking = True
            self.timer(self.tick_s, TICK, None)
        while True:
            self._start_ready()
            t_step = self.cpu.next_time(self.now)
            t_timer = self.timers[0][0] if self.timers else math.inf
            nxt = self.next_arrival
            t_arr = self.reqs[self.order[nxt]].arrival_s if nxt < len(self.order) else math.inf
            t = min(t_step, t_timer, t_arr)
            if t == math.inf or (t_step == t_arr == math.inf and self.done()):
                return True
            if t > t_stop:
                self._advance(t_stop)
                return False
            self._advance(t)
            self._events()
            if self.flipped:
                return self.done()

    def _advance(self, t: float) -> None:
        t = max(self.now, t)
        self.cpu.advance(t - self.now)
        self.now = t

    def _events(self) -> None:
        for w in self.cpu.finished():
            if isinstance(w, Worker):
                self.finish_step(w)
        while self.timers and self.timers[0][0] <= self.now:
            _, _, kind, payload = heapq.heappop(self.timers)
            if kind == FIRST:
                assert isinstance(payload, Job)
                self.first_token(payload)
            elif kind == FLIP:
                assert isinstance(payload, Worker)
                self._flip(payload)
            elif kind == ABORT:
                assert isinstance(payload, tuple)
                w, drain = payload
                if w.drains == drain:
                    self._abort_drain(w)
            else:
                assert self.on_tick is not None
                self.on_tick(self)
                if not self.done():
                    self.timer(self.now + self.tick_s, TICK, None)
        while (
            self.next_arrival < len(self.order)
            and self.reqs[self.order[self.next_arrival]].arrival_s <= self.now
        ):
            self.arrive(self.order[self.next_arrival])
            self.next_arrival += 1

    def run(self) -> list[SimOutcome]:
        while not self.run_until(math.inf):
            self.flipped.clear()
        return self.out


def simulate(
    requests: Sequence[SimRequest],
    spec: ClusterSpec,
    cost: CostModel,
    router: Router | None = None,
    policy: str = "least_load",
) -> list[SimOutcome]:
    """Run `requests` through the model of `spec` (module docstring); one outcome each.
    `policy`: the router's policy by name (`router` overrides its pair choice)."""
    return Sim(requests, spec, cost, router, policy=policy).run()


def charged(requests: Sequence[SimRequest], spec: ClusterSpec, cost: CostModel) -> dict[str, float]:
    """CPU seconds the simulator's model steps take on each role for `requests`: step time
    times the worker's threads, as the shared CPU charges them (side work not included; a
    colocated worker's steps count as decode), the tokens generated, and the prompt tokens
    whose KV moved from a prefill to a decode worker: what `costs.fit_cpu_overheads`
    compares measured CPU time with."""
    sim = Sim(requests, spec, cost)
    sim.run()
    remote = Route.REMOTE.value
    moved = sum(r.input_len for r, o in zip(requests, sim.out, strict=True) if o.path == remote)
    return {
        "prefill_steps_s": sim.step_core_s["prefill"],
        "decode_steps_s": sim.step_core_s["decode"] + sim.step_core_s["colocated"],
        "tokens": float(sim.tokens),
        "kv_prompt_tokens": float(moved),
    }
