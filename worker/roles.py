"""What a worker role is: the engine-thread half of the RPCs one role serves.

Runs in the engine thread of every worker process; nothing here is thread-safe and nothing
blocks. The engine thread (`worker.engine_thread`) owns one `RoleHandler` at a time and calls:

- `handle(method, request, sink, timeout_s)` for each accepted RPC (it has already checked the
  role and the draining state). Rejections raise `WorkerError`; the engine thread fails the
  sink with it. A handler that raises must have undone whatever it started.
- `before_forward(scheduled)` just before each forward; the callback it returns becomes the
  runner's ``on_layer_done``. It must not raise (a forward cannot be half-undone).
- `on_outputs(outputs, started, ended)` after each step, with the step's wall-clock bounds.
- `on_transfer_results(results)` with every `TransferResult` that ``transport.poll()`` returns.
- `expire(now)` every loop iteration: deadlines and reservation lifetimes.
- `abort(request_id, sink, error)` for the Abort RPC (``sink`` None) and for a cancelled RPC
  handler (``sink`` = that RPC's sink, so only the request it started is touched). It answers
  the request's open RPCs with `error` and releases what the request holds, exactly once
  (blocks of a transfer in flight: when its result arrives). Returns whether it found it.

`num_active()` counts requests the role still holds anything for; a role switch waits until
it is 0. Block ownership: every KV block is the engine scheduler's (a decode reservation is a
"receiving KV" reservation there, `Scheduler.reserve_remote`); a role holds none itself, so
`LLMEngine.check_integrity` sees them all.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import grpc

from kvtransfer.base import KVTransport
from kvtransfer.types import TransferResult
from model_runtime.engine import LayerCallback, LLMEngine
from model_runtime.request import RequestOutput
from model_runtime.scheduler import SchedulerOutput
from worker.sinks import Sink, WorkerError


@dataclass
class RoleContext:
    """What every role works with (engine-thread only)."""

    engine: LLMEngine
    transport: KVTransport
    worker_id: str
    epoch: int
    transfer_timeout_s: float
    default_timeout_s: float


def ms(seconds: float) -> float:
    return round(seconds * 1000.0, 3)


class RoleHandler(ABC):
    """One role's request handling on the engine thread (see the module docstring)."""

    name: ClassVar[str]
    methods: ClassVar[frozenset[str]]  # RPCs this role serves
    new_work: ClassVar[frozenset[str]]  # of those, the ones refused while draining
    # Of those, the ones that may also run between two layers of a forward pass (so a long
    # step does not delay them): they must not touch the step's scheduled requests.
    between_layers: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, ctx: RoleContext) -> None:
        self.ctx = ctx
        self.engine = ctx.engine

    @abstractmethod
    def handle(self, method: str, request: Any, sink: Sink, timeout_s: float | None) -> None: ...

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        return None

    @abstractmethod
    def on_outputs(
        self, outputs: Sequence[RequestOutput], started: float, ended: float
    ) -> None: ...

    def on_transfer_results(self, results: Sequence[TransferResult]) -> None:
        raise AssertionError(f"role {self.name} started no transfer, got results {results}")

    @abstractmethod
    def expire(self, now: float) -> None: ...

    @abstractmethod
    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool: ...

    @abstractmethod
    def request_ids(self) -> list[str]: ...

    def abort_all(self, error: WorkerError) -> None:
        for rid in self.request_ids():
            self.abort(rid, None, error)

    def num_active(self) -> int:
        return len(self.request_ids())

    def transfers_in_flight(self) -> bool:
        return False

    def num_pending(self) -> int:
        """Requests the role holds that the engine has not seen yet (status: waiting)."""
        return 0

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
