"""The simulator's workers and jobs: per-worker state and the O(1) decode-batch bookkeeping.

Pure; used only by `sim.py` (the event loop). A decode batch is not walked token by token:
`Decoding` keeps the batch size, the sum of its contexts and each request's finishing step
in a heap, so a step costs O(1) plus the requests that finish in it — the simulator then
runs clusters of tens of workers over minutes of traffic in seconds.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from tooling.planner.sim_types import SimRequest


@dataclass(eq=False)
class Job:
    """One request inside the simulator. `decode` is the worker holding its KV blocks
    (its decode worker, or its colocated worker)."""

    idx: int
    req: SimRequest
    decode: Worker
    prefill: Worker | None = None
    done: int = 0  # prompt tokens prefilled
    first_s: float = 0.0  # when the client got the first token
    finish_step: int = 0  # the decode step count at which it has all its tokens
    transfer_s: float = 0.0  # KV hand-off delay after the prefill (pair-dependent)
    ended: bool = False


@dataclass(eq=False)
class Decoding:
    """A continuous batch: `batch` requests holding `context` tokens in all; `steps` decode
    steps completed so far. A request joining before step k (0-based count of completed steps)
    with prompt n needs output - 1 steps: it finishes when `steps` reaches k + output - 1."""

    batch: int = 0
    context: int = 0
    steps: int = 0
    heap: list[tuple[int, int, Job]] = field(default_factory=list)
    seq: int = 0

    def join(self, job: Job) -> None:
        """`job` decodes from the next step on (context: prompt + first token)."""
        self.batch += 1
        self.context += job.req.input_len + 1
        job.finish_step = self.steps + job.req.output_len - 1
        self.seq += 1
        heapq.heappush(self.heap, (job.finish_step, self.seq, job))

    def step_done(self) -> list[Job]:
        """One step completed: every request gained a token; returns those now finished."""
        self.steps += 1
        self.context += self.batch
        out = []
        while self.heap and self.heap[0][0] <= self.steps:
            _, _, job = heapq.heappop(self.heap)
            out.append(job)
            self.batch -= 1
            self.context -= job.req.input_len + job.req.output_len
        return out

    def tokens_of(self, job: Job) -> int:
        """Decode tokens `job` has produced so far."""
        return self.steps - (job.finish_step - (job.req.output_len - 1))

    def drop(self, job: Job) -> None:
        """Remove `job` before it finished (an aborted drain)."""
        made = self.tokens_of(job)
        self.heap = [e for e in self.heap if e[2] is not job]
        heapq.heapify(self.heap)
        self.batch -= 1
        self.context -= job.req.input_len + 1 + made


@dataclass(eq=False)
class Worker:
    """One simulated worker. `kind`: prefill | decode | colocated (side entities: side | host).

    prefill: `queue` FIFO of prompts (`qtokens` tokens still to prefill);
    decode: `queue` of requests waiting to join `dec` (the running batch);
    colocated: `queue` of routed requests not yet admitted, `pre` admitted and prefilling,
    `dec` decoding. `held`: requests whose KV blocks it holds (decode, colocated).
    """

    kind: str
    index: int
    threads: float = 1.0
    node: str = ""
    queue: deque[Job] = field(default_factory=deque)
    qtokens: int = 0
    pre: list[Job] = field(default_factory=list)
    dec: Decoding = field(default_factory=Decoding)
    step: list[tuple[Job, int]] | None = None  # the step in progress: (job, prompt tokens)
    free_blocks: int = 0
    held: int = 0
    drain_to: str = ""  # draining to switch to this role ("" = not draining)
    flipping: bool = False  # drained; back in its new role after `role_switch_s`
    finish_v: float = 0.0  # virtual time the step (or side work) in progress ends
    version: int = 0  # heap entries of older versions are stale
    drains: int = 0  # role switches begun (an abort timer names the one it is for)
    busy: bool = False
    threads_busy: float = 0.0  # threads the work in progress keeps busy

    @property
    def running(self) -> int:
        return self.dec.batch + len(self.pre)

    def idle(self) -> bool:
        """Holds nothing: may switch role."""
        return (
            self.step is None
            and not self.queue
            and not self.pre
            and self.dec.batch == 0
            and self.held == 0
        )

    def has_work(self) -> bool:
        if self.kind == "prefill":
            return bool(self.queue)
        return bool(self.queue or self.pre or self.dec.batch)
