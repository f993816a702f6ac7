"""What a worker role is: the engine-thread half of the RPCs one role serves.

Runs in the engine thread of every worker process; nothing here is thread-safe and nothing
blocks. A role is a thin typed adapter from RPCs to sinks: every KV block and every request's
engine state (queued, running, sending KV, receiving KV) is the engine scheduler's, and every
KV hand-off goes through the worker's hand-off owner (`worker.kv_handoff.KVHandoff`, in the
role's context), so a role never touches the scheduler or a transport; it keeps only what it
needs to answer its RPCs (their sinks, timings, deadlines). The engine thread
(`worker.engine_thread`) owns one `RoleHandler` at a time and calls:

- for each accepted RPC (it has already checked the role and the draining state), the typed
  entry point its `Rpc` names in the role's `rpcs` table (`dispatch`: a method the role does
  not serve is refused with `WorkerError` UNIMPLEMENTED, never an assert), e.g.
  ``RemoteDecodeRole.reserve(request, sink, timeout_s)`` for `Reserve`. Rejections raise
  `WorkerError`; the engine thread fails the sink with it. An entry point that raises must
  have undone whatever it started.
- `before_forward(scheduled)` just before each forward; the callback it returns becomes the
  runner's ``on_layer_done``. It must not raise (a forward cannot be half-undone).
- `on_outputs(outputs, started, ended)` after each step, with the step's wall-clock bounds.
- `on_handoff(outcomes)` with the `HandoffOutcome`s of the hand-offs it started (a send's or
  a reservation's transfer ended), by request id, from `KVHandoff.poll`.
- `expire(now)` every loop iteration: deadlines and reservation lifetimes.
- `abort(request_id, sink, error)` for the Abort RPC (``sink`` None) and for a cancelled RPC
  handler (``sink`` = that RPC's sink, so only the request it started is touched). It answers
  the request's open RPCs with `error` and gives up what the request holds
  (`KVHandoff.abandon`: blocks of a transfer in flight are freed at its result). Returns
  whether it found it.

`num_active()` counts requests whose RPCs the role still answers; a role switch waits until
it is 0 and the hand-off owner has no abandoned transfer left. Block ownership: every KV block
is the engine scheduler's (a decode reservation is a "receiving KV" reservation there, a
prefill request's blocks a transfer reads a "sending KV" entry, a given-up transfer's blocks
an abandoned entry); a role holds none itself, so `LLMEngine.check_integrity` sees them all.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import grpc

from model_runtime.engine import LayerCallback, LLMEngine
from model_runtime.request import RequestOutput
from model_runtime.scheduler_types import SchedulerOutput
from worker.kv_handoff import HandoffOutcome, KVHandoff
from worker.sinks import Sink, WorkerError


@dataclass
class RoleContext:
    """What every role works with (engine-thread only)."""

    engine: LLMEngine
    handoff: KVHandoff  # the one place KV hand-offs meet the transport and the scheduler
    worker_id: str
    transfer_timeout_s: float
    default_timeout_s: float


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class HasRequestId(Protocol):
    """Every worker RPC's request names the request it is for."""

    @property
    def request_id(self) -> str: ...


H = TypeVar("H", bound="RoleHandler")
Req = TypeVar("Req", bound=HasRequestId)
S = TypeVar("S", bound=Sink)


@dataclass(frozen=True)
class Rpc(Generic[H, Req, S]):
    """One RPC a role serves: its gRPC method name and its typed entry point
    ``entry(role, request, sink, timeout_s)``, which answers through `sink` (or raises
    `WorkerError`, having undone what it started)."""

    method: str
    entry: Callable[[H, Req, S, float | None], None]
    request_type: type[Req]
    sink_type: type[S]
    new_work: bool = True  # refused while draining (False: continues work already accepted)
    # May also run between two layers of a forward pass (so a long step does not delay it):
    # it must not touch the step's scheduled requests.
    between_layers: bool = False

    def request_id(self, request: object) -> str:
        """The request id `request` (of `request_type`) names."""
        return self._checked(request).request_id

    def _checked(self, request: object) -> Req:
        if not isinstance(request, self.request_type):
            raise WorkerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.method} takes a {self.request_type.__name__}, got {type(request).__name__}",
            )
        return request

    def call(self, role: H, request: object, sink: Sink, timeout_s: float | None) -> None:
        """Run the entry point. `WorkerError` (INVALID_ARGUMENT) for a request or sink of
        another type than the method's (the gRPC service's contract)."""
        checked = self._checked(request)
        if not isinstance(sink, self.sink_type):
            raise WorkerError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{self.method} answers through a {self.sink_type.__name__}, got "
                f"{type(sink).__name__}",
            )
        self.entry(role, checked, sink, timeout_s)


class RoleHandler(ABC):
    """One role's request handling on the engine thread (see the module docstring).

    A subclass lists its RPCs in `rpcs`; `methods`, `new_work`, `between_layers` and
    `rpc_table` are derived from it when the class is created."""

    name: ClassVar[str]
    rpcs: ClassVar[tuple[Rpc[Any, Any, Any], ...]] = ()
    rpc_table: ClassVar[Mapping[str, Rpc[Any, Any, Any]]] = {}  # by method
    methods: ClassVar[frozenset[str]] = frozenset()  # RPCs this role serves
    new_work: ClassVar[frozenset[str]] = frozenset()  # of those, the ones refused while draining
    between_layers: ClassVar[frozenset[str]] = frozenset()  # see `Rpc.between_layers`

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.rpc_table = {rpc.method: rpc for rpc in cls.rpcs}
        assert len(cls.rpc_table) == len(cls.rpcs), (cls.__name__, "an RPC listed twice")
        cls.methods = frozenset(cls.rpc_table)
        cls.new_work = frozenset(r.method for r in cls.rpcs if r.new_work)
        cls.between_layers = frozenset(r.method for r in cls.rpcs if r.between_layers)

    @classmethod
    def rpc(cls, method: str) -> Rpc[Any, Any, Any]:
        """The entry of RPC `method`; `WorkerError` (UNIMPLEMENTED) when this role serves no
        such RPC."""
        entry = cls.rpc_table.get(method)
        if entry is None:
            raise WorkerError(
                grpc.StatusCode.UNIMPLEMENTED,
                f"role '{cls.name}' serves no RPC {method!r} (it serves {sorted(cls.methods)})",
            )
        return entry

    def dispatch(self, method: str, request: object, sink: Sink, timeout_s: float | None) -> None:
        """Run RPC `method`'s entry point (`rpc`); what it raises is the RPC's answer."""
        self.rpc(method).call(self, request, sink, timeout_s)

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine
        self.handoff = ctx.handoff

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        return None

    @abstractmethod
    def on_outputs(
        self, outputs: Sequence[RequestOutput], started: float, ended: float
    ) -> None: ...

    def on_handoff(self, outcomes: Sequence[HandoffOutcome]) -> None:
        """The outcomes of hand-offs this role started (none by default)."""
        assert not outcomes, f"role {self.name} started no KV hand-off, got {outcomes}"

    @abstractmethod
    def expire(self, now: float) -> None: ...

    @abstractmethod
    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool: ...

    @abstractmethod
    def request_ids(self) -> list[str]: ...

    def holds(self, request_id: str) -> bool:
        """Whether this role holds anything for `request_id` (its RPCs are open)."""
        return request_id in self.request_ids()

    def abort_all(self, error: WorkerError) -> None:
        for rid in self.request_ids():
            self.abort(rid, None, error)

    def num_active(self) -> int:
        """Requests whose RPCs this role still answers."""
        return len(self.request_ids())

    # ---- helpers for subclasses --------------------------------------------------------------

    def deadline(self, timeout_s: float | None) -> float:
        """`time.monotonic()` deadline for a request with `timeout_s` (None: the default)."""
        return time.monotonic() + (timeout_s if timeout_s else self.ctx.default_timeout_s)

    def invalid(self, exc: ValueError) -> WorkerError:
        return WorkerError(grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    def duplicate(self, request_id: str) -> WorkerError:
        return WorkerError(
            grpc.StatusCode.ALREADY_EXISTS,
            f"request id {request_id!r} is already in use on worker {self.ctx.worker_id}",
        )

    def expired(self, request_id: str, what: str) -> WorkerError:
        return WorkerError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"request {request_id!r}: deadline passed while {what} on worker "
            f"{self.ctx.worker_id}; its KV blocks were released",
        )
