"""The simulator's workers and jobs. Pure; used by `sim.py` (the event loop), the CPU model and
the routing seam.

A worker's requests live in its real scheduler (`sim_engine.SimEngine`); what is kept here is
only what the scheduler does not know: which simulated request an engine request id is, the
step in progress, the worker's role and its drain, and its place on the shared CPU (`Entity`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tooling.planner.sim_engine import SimEngine, Step, prompt_tokens
from tooling.planner.sim_types import SimRequest


class Route(enum.Enum):
    """How a request is served: on one colocated worker; on a disaggregated decode worker that
    prefills it itself (LOCAL, hybrid); or through a prefill worker and a KV hand-off."""

    COLOCATED = "colocated"
    LOCAL = "local"
    REMOTE = "remote"


@dataclass(eq=False)
class Entity:
    """Something that keeps threads busy on the shared CPU (`sim_cpu.SharedCpu`): a worker's
    steps, a worker's side threads ("side") or the router + client ("host")."""

    kind: str
    index: int
    threads: float = 1.0
    finish_v: float = 0.0  # virtual time the work in progress ends
    version: int = 0  # heap entries of older versions are stale
    busy: bool = False
    threads_busy: float = 0.0  # threads the work in progress keeps busy
    efficiency: float = 1.0  # share turned into progress while the cores are oversubscribed
    remaining: float = 0.0  # work left (seconds at full speed), when efficiency < 1


@dataclass(eq=False)
class Worker(Entity):
    """One simulated worker. `kind`: prefill | decode | colocated. `engine`: its real
    scheduler; `jobs`: the requests it holds anything for, by engine request id."""

    node: str = ""
    engine: SimEngine | None = None
    step: Step | None = None  # the step in progress
    jobs: dict[str, Job] = field(default_factory=dict)
    drain_to: str = ""  # draining to switch to this role ("" = not draining)
    flipping: bool = False  # drained; back in its new role after `role_switch_s`
    drains: int = 0  # role switches begun (an abort timer names the one it is for)

    @property
    def eng(self) -> SimEngine:
        assert self.engine is not None, self
        return self.engine

    def idle(self) -> bool:
        """Holds nothing: may switch role."""
        return self.step is None and not self.jobs and not self.eng.busy()

    def has_work(self) -> bool:
        return self.eng.has_work()


@dataclass(eq=False)
class Job:
    """One request inside the simulator. `decode`: the worker that decodes it (its colocated
    worker, or its decode worker); `prefill`: its prefill worker (REMOTE only). `rid`: its
    engine request id (on every worker); `transfer_id`: its KV transfer's (REMOTE: the
    decode worker's ticket's)."""

    idx: int
    req: SimRequest
    decode: Worker
    route: Route
    prefill: Worker | None = None
    first_s: float | None = None  # when the client got the first token
    transfer_s: float = 0.0  # KV hand-off delay after the prefill (pair-dependent)
    transfer_id: str = ""
    ended: bool = False

    @property
    def rid(self) -> str:
        return f"r{self.idx}"

    @property
    def seed(self) -> int:
        """> 0: the prompt is private (`sim_engine.prompt_tokens`); 0: its token ids are given."""
        return 0 if self.req.tokens else self.idx + 1

    @property
    def prompt(self) -> list[int]:
        r = self.req
        return list(r.tokens) if r.tokens else prompt_tokens(self.seed, r.input_len)
