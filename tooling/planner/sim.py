"""Discrete-event simulator of a pdserve cluster (the planner's and the controller's model).

Pure Python, deterministic; runs in `pdserve plan`, `pdserve plan --validate`,
`pdserve simulate` and the benchmarks. It mirrors the real system at the level of engine steps:

- **router**: at most `max_inflight` requests run (FIFO queue beyond, `max_queued` long; a
  request that finds it full fails at once). Disaggregated: each is
  routed on arrival to a (prefill, decode) pair by the `router` (default `least_load`: the decode
  worker with the fewest requests that has free KV blocks for prompt + output - 1 tokens, held
  until the request ends — none has room: the request fails, like RESOURCE_EXHAUSTED — and the
  prefill worker with the fewest queued prompt tokens). Colocated: the worker holding the
  fewest requests; it admits the request once its blocks are free;
- **prefill worker**: FIFO; one step takes chunks from the queue up to `chunk_tokens` tokens
  and `max_num_seqs` requests (chunked prefill; `chunked=False`: a prompt runs whole in one step
  or waits). Step time `cost.prefill_s(chunks)`. A request whose last chunk finished waits its
  KV hand-off (`cost.transfer`, or the pair's link) and `cost.ttft_overhead` (router, RPCs):
  then the client has its first token (TTFT) and the request joins its decode worker;
- **decode worker**: continuous batching; a request joins the batch at the first step that
  starts after its first token (at most `max_num_seqs` running); a step of batch B over total
  context C takes `cost.decode_s(B, C)`; a request ends after output - 1 decode tokens;
- **colocated worker** (Sarathi-style, as the engine's scheduler): each step runs one token
  for every decoding request, then prompt chunks fill the rest of `chunk_tokens`;
  `cost.mixed_s`. A finished prompt's first token reaches the client `cost.ttft_overhead`
  later; the request decodes from the next step;
- **CPU sharing**: with `cores` set, every worker's step keeps `threads` cores busy, and the
  busy entities share the cores equally (processor sharing: each advances at
  min(1, cores / busy threads) of full speed). CPU spent beside the steps runs on "side"
  entities that share the cores the same way: one per worker (its gRPC / transport threads:
  `cost.prefill_request_s` per prompt, `cost.decode_token_cpu_s` per token) and one for the
  router + client ("host": `cost.host_request_s` per request, `cost.host_token_s` per token).
  With `cores=None` each worker has its own device and side work is not modelled.
- **role switches** (`switch`): a worker drains — no new work, finishes what it holds — then
  comes back in its new role `role_switch_s` later; past `drain_timeout_s` what it still holds
  is aborted (those requests fail), as `SetRole` does.

Time: the shared cores are `sim_cpu.SharedCpu` (virtual time); what a step holds and costs is
`sim_steps.compose`.

`simulate(requests, spec, cost)` returns one `SimOutcome` per request (same order), with the
client's TTFT and TPOT (first token to last, over output - 1 tokens), the goodput-bench way.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

from tooling.planner.costs import CostModel
from tooling.planner.sim_cpu import SharedCpu
from tooling.planner.sim_routing import Pick, Router, least_load
from tooling.planner.sim_steps import blocks, compose
from tooling.planner.sim_types import ClusterSpec, SimOutcome, SimRequest, attainment
from tooling.planner.sim_workers import Job, Worker

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
    flip, so a controller sees it when it happens); `on_tick(sim)` runs every `tick_s`."""

    def __init__(
        self,
        reqs: Sequence[SimRequest],
        spec: ClusterSpec,
        cost: CostModel,
        router: Router | None = None,
        drain_timeout_s: float = math.inf,
    ) -> None:
        self.reqs, self.spec, self.cost = reqs, spec, cost
        self.router: Router = router or least_load
        self.drain_timeout_s = drain_timeout_s
        self.out = [SimOutcome() for _ in reqs]
        kinds = ["prefill"] * spec.prefill + ["decode"] * spec.decode
        kinds += ["colocated"] * spec.colocated
        nodes = spec.nodes or ("",) * len(kinds)
        self.workers = [
            Worker(k, i, spec.threads, nodes[i], free_blocks=spec.num_kv_blocks)
            for i, k in enumerate(kinds)
        ]
        self.host = Worker("host", -1)
        self.sides = [Worker("side", w.index) for w in self.workers]
        self.timers: list[tuple[float, int, int, object]] = []
        self.on_tick: Callable[[Sim], None] | None = None
        self.tick_s = 0.0
        self.on_end: Callable[[int, SimOutcome], None] | None = None
        # KV hand-off delay, decided when the prompt's last chunk is done (default: the
        # router's `transfer_s`); `pairing.Links` models links that requests share
        self.handoff: Callable[[Sim, Job], float] | None = None
        self.flipped: list[Worker] = []  # flips since the caller last cleared it
        self.step_s = {"prefill": 0.0, "decode": 0.0, "colocated": 0.0}
        self.tokens = 0  # generated tokens, first tokens included
        self.seq = 0
        self.inflight = 0
        self.router_q: deque[int] = deque()
        self.now = 0.0
        self.cpu = SharedCpu(spec.cores)
        self.ready: set[Worker] = set(self.workers)
        self.aborted = 0  # drains that timed out
        self.order = sorted(range(len(reqs)), key=lambda i: (reqs[i].arrival_s, i))
        self.next_arrival = 0
        self.ticking = False

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
        w.free_blocks = self.spec.num_kv_blocks
        w.drains += 1  # an abort timer of this drain no longer applies
        self.flipped.append(w)
        self.ready.add(w)

    def _abort_drain(self, w: Worker) -> None:
        """The drain timed out: what `w` still holds fails (SetRole aborts it)."""
        if not w.drain_to or w.flipping:
            return
        self.aborted += 1
        victims = [j for j, _ in w.step or ()] + list(w.queue) + list(w.pre)
        victims += [e[2] for e in w.dec.heap]
        for job in victims:
            self.fail(job)
        self.cpu.cancel(w)
        w.step = None
        self._check_drained(w)

    # ---- the shared CPU ----------------------------------------------------------------------

    def host_work(self, seconds: float, worker: Worker | None = None) -> None:
        """Queue CPU work beside the steps: on `worker`'s side threads, or the host's."""
        if self.spec.cores is not None and seconds > 0:
            self.cpu.busy(self.host if worker is None else self.sides[worker.index], seconds, 1.0)

    def blocks(self, r: SimRequest) -> int:
        return blocks(self.spec, r)

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
        need = self.blocks(r)
        if self.spec.colocated:
            ws = self.role("colocated")
            if not ws:
                self._reject(i)
                return
            w = min(ws, key=lambda x: (x.held, x.index))
            w.held += 1
            job = Job(i, r, w)
            self._admit()
            w.queue.append(job)
            self.ready.add(w)
            return
        room = [w for w in self.role("decode") if w.free_blocks >= need]
        pick = self.router(self, r, self.role("prefill"), room)
        if pick is None:
            self._reject(i)
            return
        p, d, transfer_s = pick
        d.free_blocks -= need
        d.held += 1
        job = Job(i, r, d, p, transfer_s=transfer_s)
        self._admit()
        p.queue.append(job)
        p.qtokens += r.input_len
        self.ready.add(p)

    def _admit(self) -> None:
        self.inflight += 1
        self.host_work(self.cost.host_request_s)

    def _reject(self, i: int) -> None:
        self.out[i] = SimOutcome(ok=False, end_s=self.now)
        if self.on_end is not None:
            self.on_end(i, self.out[i])

    def end(self, job: Job, ok: bool) -> None:
        """`job` ended (all tokens, or failed): free its blocks, admit from the router queue."""
        if job.ended:
            return
        job.ended = True
        d = job.decode
        if self.spec.colocated:
            if job.done >= job.req.input_len or job in d.pre:
                d.free_blocks += self.blocks(job.req)
        else:
            d.free_blocks += self.blocks(job.req)
        d.held -= 1
        self.ready.add(d)
        self._check_drained(d)
        self.inflight -= 1
        o = self.out[job.idx]
        o.ok = ok
        o.end_s = self.now
        if self.on_end is not None:
            self.on_end(job.idx, o)
        while self.router_q and self.inflight < self.spec.max_inflight:
            self.route(self.router_q.popleft())

    def fail(self, job: Job) -> None:
        """Abort `job` wherever it is (a drain that timed out)."""
        for w in (job.prefill, job.decode):
            if w is None:
                continue
            if job in w.queue:
                w.queue.remove(job)
                if w.kind == "prefill":
                    w.qtokens -= job.req.input_len - job.done
            if job in w.pre:
                w.pre.remove(job)
            if any(e[2] is job for e in w.dec.heap):
                w.dec.drop(job)
        self.end(job, ok=False)

    # ---- steps -----------------------------------------------------------------------------

    def start_step(self, w: Worker) -> None:
        planned = compose(self.spec, self.cost, w)
        if planned is None:
            return
        w.step, work = planned
        self.step_s[w.kind] += work
        self.cpu.busy(w, work, w.threads)

    def finish_step(self, w: Worker) -> None:
        step, w.step = w.step or [], None
        if w.kind in ("decode", "colocated") and (w.kind == "decode" or w.dec.batch):
            made = w.dec.batch
            self.tokens += made
            self.host_work(self.cost.host_token_s * made)
            self.host_work(self.cost.decode_token_cpu_s * made, w)
            for job in w.dec.step_done():
                o = self.out[job.idx]
                o.tpot_s = (self.now - job.first_s) / (job.req.output_len - 1)
                self.end(job, ok=True)
        for job, n in step:
            job.done += n
            if w.kind == "prefill":
                w.qtokens -= n
            if job.done < job.req.input_len:
                continue
            n_in = job.req.input_len
            over = max(0.0, self.cost.ttft_overhead(n_in))
            if w.kind == "prefill":
                w.queue.remove(job)
                self.host_work(self.cost.prefill_request_s, w)  # response + KV send
                moved = job.transfer_s if self.handoff is None else self.handoff(self, job)
                self.timer(self.now + max(0.0, moved) + over, FIRST, job)
            else:
                w.pre.remove(job)
                if job.req.output_len == 1:
                    self.timer(self.now + over, FIRST, job)
                else:
                    self._first(job, self.now + over)
                    w.queue.appendleft(job)  # joins the batch at the next step
        self._check_drained(w)
        self.ready.add(w)

    def _first(self, job: Job, t: float) -> None:
        """The client has `job`'s first token at `t` (set now; counted in `tokens`)."""
        job.first_s = t
        self.tokens += 1
        self.host_work(self.cost.host_token_s)
        self.out[job.idx].ttft_s = t - job.req.arrival_s
        if job.req.output_len == 1:
            self.end(job, ok=True)

    def first_token(self, job: Job) -> None:
        """Disaggregated: KV landed and the first token reached the client; decode it."""
        if job.ended:
            return
        self._first(job, self.now)
        if job.req.output_len > 1 and not self.spec.colocated:
            job.decode.queue.append(job)
            self.ready.add(job.decode)

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
            if w.kind in ("prefill", "decode", "colocated"):
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
) -> list[SimOutcome]:
    """Run `requests` through the model of `spec` (module docstring); one outcome each."""
    return Sim(requests, spec, cost, router).run()


def charged(requests: Sequence[SimRequest], spec: ClusterSpec, cost: CostModel) -> dict[str, float]:
    """Step seconds the simulator charges each role for `requests` (side work not included;
    a colocated worker's steps count as decode) and the tokens generated: what
    `costs.fit_cpu_overheads` compares measured CPU time with."""
    sim = Sim(requests, spec, cost)
    sim.run()
    return {
        "prefill_steps_s": sim.step_s["prefill"],
        "decode_steps_s": sim.step_s["decode"] + sim.step_s["colocated"],
        "tokens": float(sim.tokens),
    }
