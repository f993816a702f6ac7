"""Discrete-event simulator of a disaggregated cluster (the offline planner's model).

Pure Python, deterministic; runs in `pdserve plan` and the benchmarks. It mirrors what the
real system does, at the level of engine steps:

- **router**: at most `max_inflight` requests run (FIFO queue beyond); each is routed on
  arrival to the decode worker with the fewest requests that has free KV blocks for
  prompt + output - 1 tokens (reserved until the request ends; none has room -> the request
  fails, like RESOURCE_EXHAUSTED) and to the prefill worker with the fewest queued prompt
  tokens (ties: lowest index);
- **prefill worker**: FIFO; one step takes chunks from the queue up to `chunk_tokens` tokens
  and `max_num_seqs` requests (chunked prefill: a long prompt spans steps; `chunked=False`:
  a prompt runs whole in one step or waits). Step time `cost.prefill_s(chunks)`. A request
  whose last chunk finished waits `cost.transfer` more (KV still in flight) and
  `cost.ttft_overhead` (router, RPCs): then the client has its first token (TTFT);
- **decode worker**: continuous batching; a request joins the running batch at the first
  step that starts after its first token (at most `max_num_seqs` running, FIFO beyond); a
  step of batch B over total context C takes `cost.decode_s(B, C)` and gives each request one
  token; a request ends after output - 1 decode tokens, and its blocks are freed;
- **CPU sharing**: with `cores` set, every worker is one single-threaded process on a shared
  CPU: while k workers are inside a step, each advances at min(1, cores / k) of full speed
  (processor sharing). CPU spent beside the steps runs on "side" queues that share the cores
  the same way: one per worker (its gRPC / transport threads: `cost.prefill_request_s` per
  prompt a prefill worker completes, `cost.decode_token_cpu_s` per token a decode worker
  produces) and one for the router + client ("host": `cost.host_request_s` per request,
  `cost.host_token_s` per streamed token). With `cores=None` each worker has its own core and
  side work is not modelled.

`simulate(requests, spec, cost)` returns one `SimOutcome` per request (same order), with the
client's TTFT and TPOT (first token to last, over output - 1 tokens), the goodput-bench way.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tooling.planner.costs import CostModel

EPS = 1e-12


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (s after t=0), prompt and output lengths (tokens, >= 1)."""

    arrival_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated cluster. Engine settings are per worker, as in `EngineConfig`."""

    prefill: int
    decode: int
    chunk_tokens: int = 256
    max_num_seqs: int = 32
    num_kv_blocks: int = 1024
    block_size: int = 16
    chunked: bool = True
    max_inflight: int = 64
    cores: float | None = None

    def __post_init__(self) -> None:
        if self.prefill < 1 or self.decode < 1:
            raise ValueError(
                f"need >= 1 prefill and decode worker, got {self.prefill}:{self.decode}"
            )
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"cores must be > 0 or None, got {self.cores}")


@dataclass
class SimOutcome:
    """What a client would have measured for one request (seconds; None when not reached)."""

    ok: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    end_s: float | None = None


@dataclass
class _Job:
    idx: int
    req: SimRequest
    decode: _Worker  # its decode worker (holds its reserved blocks)
    done: int = 0  # prompt tokens prefilled
    first_s: float = 0.0
    tokens: int = 0  # decode tokens produced


@dataclass(eq=False)
class _Worker:
    kind: str
    index: int
    queue: deque[_Job] = field(default_factory=deque)  # prefill: FIFO; decode: waiting
    running: list[_Job] = field(default_factory=list)  # decode: the batch
    step: list[tuple[_Job, int]] | None = None  # the step in progress: (job, tokens)
    left: float = 0.0  # seconds of full-speed work left in the step
    free_blocks: int = 0
    held: int = 0  # decode: requests routed here and not ended
    drain_to: str = ""  # draining to switch to this role ("" = not draining)

    def queued_tokens(self) -> int:
        return sum(j.req.input_len - j.done for j in self.queue)

    def idle(self) -> bool:
        """Holds nothing: may switch role."""
        return self.step is None and not self.queue and not self.running and self.held == 0


class _Sim:
    """The model of the module docstring. `workers` keep their identity across role switches
    (`switch(w, role)`: drain, then flip); `on_tick(sim)` runs every `tick_s` of simulated
    time (the adaptive controller hooks in there)."""

    def __init__(self, reqs: Sequence[SimRequest], spec: ClusterSpec, cost: CostModel) -> None:
        self.reqs, self.spec, self.cost = reqs, spec, cost
        self.out = [SimOutcome() for _ in reqs]
        n = spec.prefill + spec.decode
        self.workers = [
            _Worker("prefill" if i < spec.prefill else "decode", i, free_blocks=spec.num_kv_blocks)
            for i in range(n)
        ]
        self.timers: list[tuple[float, int, int, _Job | None]] = []  # (time, seq, kind, job)
        self.on_tick: Callable[[_Sim], None] | None = None
        self.tick_s = 0.0
        self.on_end: Callable[[int, SimOutcome], None] | None = None
        self.host = _Worker("host", -1)  # router + client CPU (only with `cores`)
        self.sides = [_Worker("side", w.index) for w in self.workers]  # per-worker threads
        self.step_s = {"prefill": 0.0, "decode": 0.0}  # model-step seconds charged (no overheads)
        self.tokens = 0  # generated tokens, first tokens included
        self.seq = 0
        self.inflight = 0
        self.router_q: deque[int] = deque()
        self.now = 0.0

    def role(self, kind: str) -> list[_Worker]:
        """Workers of `kind` that take new work (not draining)."""
        return [w for w in self.workers if w.kind == kind and not w.drain_to]

    def switch(self, w: _Worker, role: str) -> None:
        """Start draining `w`; it flips to `role` once it holds nothing (`_flip_drained`)."""
        assert role in ("prefill", "decode") and role != w.kind and not w.drain_to, (w, role)
        w.drain_to = role

    def _flip_drained(self) -> list[_Worker]:
        done = [w for w in self.workers if w.drain_to and w.idle()]
        for w in done:
            w.kind, w.drain_to = w.drain_to, ""
            w.free_blocks = self.spec.num_kv_blocks
        return done

    def host_work(self, seconds: float, worker: _Worker | None = None) -> None:
        """Queue CPU work beside the steps: on `worker`'s side threads, or the host's."""
        if self.spec.cores is not None:
            (self.host if worker is None else self.sides[worker.index]).left += seconds

    def blocks(self, r: SimRequest) -> int:
        return math.ceil((r.input_len + r.output_len - 1) / self.spec.block_size)

    # ---- router ----------------------------------------------------------------------------

    def arrive(self, i: int) -> None:
        if self.inflight >= self.spec.max_inflight:
            self.router_q.append(i)
            return
        self.route(i)

    def route(self, i: int) -> None:
        r = self.reqs[i]
        need = self.blocks(r)
        room = [w for w in self.role("decode") if w.free_blocks >= need]
        prefill = self.role("prefill")
        if not room or not prefill:
            self.out[i] = SimOutcome(ok=False, end_s=self.now)
            self._ended(i)
            return
        d = min(room, key=lambda w: (w.held, -w.free_blocks, w.index))
        p = min(prefill, key=lambda w: (w.queued_tokens(), len(w.queue), w.index))
        d.free_blocks -= need
        d.held += 1
        self.inflight += 1
        self.host_work(self.cost.host_request_s)
        p.queue.append(_Job(i, r, d))

    def _ended(self, i: int) -> None:
        if self.on_end is not None:
            self.on_end(i, self.out[i])

    def end(self, job: _Job) -> None:
        d = job.decode
        d.free_blocks += self.blocks(job.req)
        d.held -= 1
        self.inflight -= 1
        self.out[job.idx].end_s = self.now
        self._ended(job.idx)
        while self.router_q and self.inflight < self.spec.max_inflight:
            self.route(self.router_q.popleft())

    # ---- workers ---------------------------------------------------------------------------

    def start_prefill(self, w: _Worker) -> None:
        budget = self.spec.chunk_tokens
        chunks: list[tuple[int, int]] = []
        step: list[tuple[_Job, int]] = []
        for job in w.queue:
            if len(step) >= self.spec.max_num_seqs or budget <= 0:
                break
            rest = job.req.input_len - job.done
            if not self.spec.chunked and rest > budget:
                break
            n = min(rest, budget)
            chunks.append((job.done, n))
            step.append((job, n))
            budget -= n
        if not step and w.queue and not self.spec.chunked:  # a prompt above the budget runs alone
            job = w.queue[0]
            step, chunks = [(job, job.req.input_len)], [(0, job.req.input_len)]
        compute = self.cost.prefill_s(chunks)
        self.step_s["prefill"] += compute
        w.step, w.left = step, compute

    def finish_prefill(self, w: _Worker) -> None:
        assert w.step is not None
        for job, n in w.step:
            job.done += n
            if job.done == job.req.input_len:
                w.queue.remove(job)
                self.host_work(self.cost.prefill_request_s, w)  # response + KV send
                n_in = job.req.input_len
                delay = max(0.0, self.cost.transfer(n_in)) + max(0.0, self.cost.ttft_overhead(n_in))
                self.timer(self.now + delay, 0, job)
        w.step = None

    def start_decode(self, w: _Worker) -> None:
        while w.queue and len(w.running) < self.spec.max_num_seqs:
            w.running.append(w.queue.popleft())
        ctx = sum(j.req.input_len + 1 + j.tokens for j in w.running)
        w.step = [(j, 1) for j in w.running]
        w.left = self.cost.decode_s(len(w.running), ctx)
        self.step_s["decode"] += w.left

    def finish_decode(self, w: _Worker) -> None:
        assert w.step is not None
        self.tokens += len(w.step)
        self.host_work(self.cost.host_token_s * len(w.step))
        self.host_work(self.cost.decode_token_cpu_s * len(w.step), w)  # streaming the tokens
        for job, _ in w.step:
            job.tokens += 1
            if job.tokens >= job.req.output_len - 1:
                w.running.remove(job)
                o = self.out[job.idx]
                o.ok = True
                o.tpot_s = (self.now - job.first_s) / job.tokens
                self.end(job)
        w.step = None

    def timer(self, t: float, kind: int, job: _Job | None) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (t, self.seq, kind, job))

    def first_token(self, job: _Job) -> None:
        job.first_s = self.now
        self.tokens += 1
        self.host_work(self.cost.host_token_s)
        o = self.out[job.idx]
        o.ttft_s = self.now - job.req.arrival_s
        if job.req.output_len == 1:
            o.ok = True
            self.end(job)
        else:
            job.decode.queue.append(job)

    # ---- the event loop --------------------------------------------------------------------

    def run(self) -> list[SimOutcome]:
        order = sorted(range(len(self.reqs)), key=lambda i: (self.reqs[i].arrival_s, i))
        nxt = 0
        workers = self.workers
        if self.on_tick is not None and self.tick_s > 0:
            self.timer(self.tick_s, 1, None)
        while True:
            self._flip_drained()
            for w in workers:
                if w.step is None:
                    if w.kind == "prefill" and w.queue:
                        self.start_prefill(w)
                    elif w.kind == "decode" and (w.queue or w.running):
                        self.start_decode(w)
            busy = [w for w in workers if w.step is not None]
            busy += [x for x in (self.host, *self.sides) if x.left > EPS]
            cores = self.spec.cores
            speed = 1.0 if cores is None or len(busy) <= cores else cores / len(busy)
            t_step = min((self.now + w.left / speed for w in busy), default=math.inf)
            t_timer = self.timers[0][0] if self.timers else math.inf
            t_arr = self.reqs[order[nxt]].arrival_s if nxt < len(order) else math.inf
            t = min(t_step, t_timer, t_arr)
            if t == math.inf or (t_step == t_arr == math.inf and self._only_ticks()):
                break
            dt = max(0.0, t - self.now)
            for w in busy:
                w.left -= dt * speed
            self.now = max(self.now, t)
            for w in busy:
                if w.left <= EPS * max(1.0, self.now):
                    w.left = 0.0
                    if w.kind == "prefill":
                        self.finish_prefill(w)
                    elif w.kind == "decode":
                        self.finish_decode(w)
            while self.timers and self.timers[0][0] <= self.now:
                _, _, kind, job = heapq.heappop(self.timers)
                if kind == 0:
                    assert job is not None
                    self.first_token(job)
                else:
                    assert self.on_tick is not None
                    self.on_tick(self)
                    self.timer(self.now + self.tick_s, 1, None)
            while nxt < len(order) and self.reqs[order[nxt]].arrival_s <= self.now:
                self.arrive(order[nxt])
                nxt += 1
        return self.out

    def _only_ticks(self) -> bool:
        """Nothing but controller ticks left (and every request has ended)."""
        return (
            all(k == 1 for _, _, k, _ in self.timers)
            and self.inflight == 0
            and not any(w.queue or w.running for w in self.workers)
        )


def simulate(
    requests: Sequence[SimRequest], spec: ClusterSpec, cost: CostModel
) -> list[SimOutcome]:
    """Run `requests` through the model of `spec` (module docstring); one outcome each."""
    return _Sim(requests, spec, cost).run()


def charged(requests: Sequence[SimRequest], spec: ClusterSpec, cost: CostModel) -> dict[str, float]:
    """Step seconds the simulator charges each role for `requests` (side work not included)
    and the tokens generated: what `costs.fit_cpu_overheads` compares measured CPU time with."""
    sim = _Sim(requests, spec, cost)
    sim.run()
    return {
        "prefill_steps_s": sim.step_s["prefill"],
        "decode_steps_s": sim.step_s["decode"],
        "tokens": float(sim.tokens),
    }


def attainment(
    outcomes: Sequence[SimOutcome], slo_ttft_s: float, slo_tpot_s: float
) -> tuple[float, float, float]:
    """(TTFT, TPOT, both) attainment, the goodput bench's definition (failed requests miss
    both; a one-token request has no TPOT and meets it). 1.0 each for no requests."""
    if not outcomes:
        return 1.0, 1.0, 1.0
    ttft = [o.ok and o.ttft_s is not None and o.ttft_s <= slo_ttft_s for o in outcomes]
    tpot = [o.ok and (o.tpot_s is None or o.tpot_s <= slo_tpot_s) for o in outcomes]
    n = len(outcomes)
    both = sum(a and b for a, b in zip(ttft, tpot, strict=True))
    return sum(ttft) / n, sum(tpot) / n, both / n
