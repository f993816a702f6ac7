"""The engine thread of a worker process: the one owner of model, KV cache, block pool and KV
hand-off owner (`worker.kv_handoff.KVHandoff`, over the KV transport), driving the current
role.

Runs in every worker process, in its own thread; the gRPC handlers on the asyncio loop reach it
only through `submit` / `cancel` / `abort` / `set_role` / `stop` (thread-safe: they enqueue a
command) and read `snapshot` (an immutable object swapped each iteration). One iteration:

1. wait for commands — up to 50 ms when idle, 2 ms while KV transfers are in flight, not at
   all while the engine has work — and run every queued one (RPCs in, aborts, role changes;
   an RPC runs the typed entry point its method names in the role's `Rpc` table);
   RPCs the role marks `between_layers` (a decode worker's Reserve) also run between two
   layers of a forward pass, so a long step does not hold them up;
   the KV transport's waker (`KVHandoff.set_waker`) ends the wait as soon as a transfer has
   news;
2. `role.expire(now)`: deadlines and reservation lifetimes;
3. one engine step if any request is unfinished (`role.before_forward` opens KV transfers,
   `role.on_outputs` delivers tokens) — unless a test holds the steps (`worker.step_gate`, off
   unless its environment variable is set: then the iteration waits briefly instead);
4. `KVHandoff.poll()` applies the transport's results to the scheduler (arrived layers,
   acks, failures) -> `role.on_handoff` with the outcomes of live hand-offs;
5. drain progress (below), then publish a new `Snapshot`.

Draining (SetRole, stop): new work (the role's `new_work` RPCs) is answered UNAVAILABLE at
once; work in flight — including Decode calls for existing reservations — runs on. When the
role holds nothing (`num_active() == 0`) and no abandoned transfer's result is still to come
(`KVHandoff.num_abandoned`), the role switches: same engine, runner, KV cache and
block pool (prefix cache kept), fresh scheduler. At the drain timeout whatever is left is
aborted (UNAVAILABLE); the switch then waits only for cancelled transfers' results, so every
block is released exactly once, by the role that took it.
A `drain_timeout_s` <= 0 means no drain limit (every request is still bounded by its own
deadline). SetRole to the current role answers at once; SetRole while draining is refused
(FAILED_PRECONDITION); `stop` overrides a role switch in progress.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc

from kvtransfer.types import TransferResult
from model_runtime.engine import LayerCallback
from model_runtime.request import RequestOutput
from model_runtime.scheduler_types import SchedulerOutput
from worker.roles import RoleContext, RoleHandler
from worker.sinks import Sink, UnarySink, WorkerError, delivered_together
from worker.step_gate import StepGate, gate_from_env

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05
TRANSFER_POLL_S = 0.002
HELD_WAIT_S = 0.01  # the command wait while a test holds the steps (`worker.step_gate`)


@dataclass(frozen=True)
class Snapshot:
    """What GetStatus reports; published by the engine thread after every iteration."""

    role: str
    draining: bool
    num_waiting: int
    num_running: int
    waiting_tokens: int
    free_blocks: int
    total_blocks: int
    block_size: int
    engine_steps: int = 0  # steps run since start, and their summed wall / thread CPU seconds
    engine_step_wall_s: float = 0.0
    engine_step_cpu_s: float = 0.0
    num_receiving: int = 0  # of num_waiting: reservations whose KV is still to arrive


@dataclass
class _Drain:
    target: str | None  # None: stopping
    deadline: float
    sink: UnarySink | None
    aborted: bool = False


class StepMetrics(Protocol):
    """What the engine thread reports to the worker's metrics (`worker.metrics`)."""

    def on_outputs(self, outputs: Sequence[RequestOutput]) -> None: ...

    def on_transfers(self, results: Sequence[TransferResult]) -> None: ...


def _nothing() -> None:
    """A command that only ends the wait (the transport's waker, between-layers RPCs)."""


def _run_one(command: Callable[[], object], sink: Sink | None) -> None:
    try:
        command()
    except Exception as exc:  # a bug: answer INTERNAL, keep serving the others
        log.exception("engine-thread command failed")
        if sink is not None:
            sink.fail(WorkerError(grpc.StatusCode.INTERNAL, f"{exc!r}"))


class EngineThread:
    """Runs the loop in the module docstring on a daemon thread (`start`, `stop`).

    `roles` maps every role name this worker may take (`role` first, then any `SetRole`
    target) to its class; the worker host plugs the role packages in here
    (`worker_main.ROLES`), so this module depends on the `RoleHandler` contract only.
    """

    def __init__(
        self,
        ctx: RoleContext,
        roles: Mapping[str, type[RoleHandler]],
        role: str,
        metrics: StepMetrics | None = None,
        gate: StepGate | None = None,
    ) -> None:
        """`gate`: may the next step run (`worker.step_gate`; default: its test hook from the
        environment, open unless a test set it)."""
        if role not in roles:
            raise ValueError(f"role must be one of {sorted(roles)}, got {role!r}")
        self.ctx = ctx
        self.engine = ctx.engine
        self.handoff = ctx.handoff
        self.metrics = metrics
        self.roles = dict(roles)
        self._served_by = {m: r.name for r in self.roles.values() for m in r.methods}
        self.role: RoleHandler = self.roles[role](ctx)
        # (command, the sink it answers or None): the sink is failed if the thread has ended
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], Sink | None]] = (
            queue.SimpleQueue()
        )
        # RPCs that may run between layers (`RoleHandler.between_layers`); always before
        # `_commands`.
        self._urgent: queue.SimpleQueue[tuple[Callable[[], object], Sink | None]] = (
            queue.SimpleQueue()
        )
        self._drain: _Drain | None = None
        self._gate = gate if gate is not None else gate_from_env(ctx.worker_id)
        self._steps = 0  # engine-thread counters, published in each Snapshot
        self._step_wall_s = 0.0
        self._step_cpu_s = 0.0
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.snapshot = self._make_snapshot()
        self.handoff.set_waker(self._wake)

    def _wake(self) -> None:
        """The transport has news (KV arrived, an ack, a failure): end the wait for commands
        now rather than at the next poll tick."""
        self._commands.put((_nothing, None))

    # ---- thread-safe API ---------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def submit(self, method: str, request: Any, sink: Sink, timeout_s: float | None) -> None:
        """Run RPC `method` on the engine thread; its answer goes to `sink`."""
        command = (lambda: self._on_rpc(method, request, sink, timeout_s), sink)
        if method in self.role.between_layers:
            self._urgent.put(command)
            self._put(_nothing, None)  # ends an idle wait on the main queue
        else:
            self._put(*command)

    def cancel(self, request_id: str, sink: Sink) -> None:
        """The RPC that owns `sink` was cancelled: abort what it started (if still there)."""
        error = WorkerError(grpc.StatusCode.CANCELLED, "the RPC was cancelled by the client")
        self._put(lambda: self.role.abort(request_id, sink, error), None)

    def abort(self, request_id: str, sink: UnarySink) -> None:
        """The Abort RPC: `sink` gets whether the request was found."""

        def run() -> None:
            error = WorkerError(grpc.StatusCode.ABORTED, f"request {request_id!r} was aborted")
            sink.set(self.role.abort(request_id, None, error))

        self._put(run, sink)

    def set_role(self, role: str, drain_timeout_s: float, sink: UnarySink) -> None:
        """Drain, then switch to `role`; `sink` gets None when done (WorkerError if refused)."""
        self._put(lambda: self._on_set_role(role, drain_timeout_s, sink), sink)

    def stop(self, grace_s: float) -> None:
        """Drain for up to `grace_s` (then abort the rest), close the transport, end the
        thread. Blocks (call it off the event loop)."""
        deadline = time.monotonic() + grace_s
        # Urgent, like the between-layers RPCs: a `Reserve` that arrives after this call (and
        # after health said NOT_SERVING) must find the drain begun, even mid-step.
        self._urgent.put((lambda: self._begin_drain(None, deadline, None), None))
        self._put(_nothing, None)  # ends an idle wait on the main queue
        self._thread.join(grace_s + 30.0)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.1f s", grace_s + 30.0)

    def _put(self, command: Callable[[], object], sink: Sink | None) -> None:
        self._commands.put((command, sink))
        if self._stopped.is_set():  # the thread may be gone: answer what is left ourselves
            self._fail_queued()

    def _fail_queued(self) -> None:
        error = WorkerError(grpc.StatusCode.UNAVAILABLE, f"worker {self.ctx.worker_id} stopped")
        for commands in (self._urgent, self._commands):
            while True:
                try:
                    _, sink = commands.get_nowait()
                except queue.Empty:
                    break
                if sink is not None:
                    sink.fail(error)

    # ---- engine thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped.is_set():
                try:
                    self._iterate()
                except Exception as exc:  # a bug: fail what is in flight, keep serving
                    log.exception("engine loop iteration failed")
                    self.role.abort_all(WorkerError(grpc.StatusCode.INTERNAL, f"engine: {exc!r}"))
        finally:
            self._shutdown()

    def _iterate(self) -> None:
        work = self.engine.has_unfinished()
        held = work and not self._gate.allows(self._steps)
        if held:
            wait = HELD_WAIT_S
        elif work and self.engine.last_step_size > 0:
            wait = 0.0
        elif work or self.handoff.in_flight():
            wait = TRANSFER_POLL_S
        else:
            wait = IDLE_WAIT_S
        self._run_commands(wait)
        self.role.expire(time.monotonic())
        if self.engine.has_unfinished() and self._gate.allows(self._steps):
            self._step()
        self._poll_handoff()
        self._drain_progress()
        self.snapshot = self._make_snapshot()

    def _run_commands(self, wait: float) -> None:
        try:
            command, sink = (
                self._commands.get(timeout=wait) if wait > 0 else self._commands.get_nowait()
            )
        except queue.Empty:
            self._run_urgent()
            return
        self._run_urgent()  # queued before anything in `_commands` that follows them
        while True:
            _run_one(command, sink)
            try:
                command, sink = self._commands.get_nowait()
            except queue.Empty:
                return

    def _run_urgent(self) -> None:
        while not self._urgent.empty():  # cheap when empty: this runs after every layer
            try:
                command, sink = self._urgent.get_nowait()
            except queue.Empty:
                return
            _run_one(command, sink)

    def _on_rpc(self, method: str, request: Any, sink: Sink, timeout_s: float | None) -> None:
        try:
            if self._drain is not None and (
                method in self.role.new_work or method not in self.role.methods
            ):
                doing = (
                    "stopping"
                    if self._drain.target is None
                    else f"draining to switch role to '{self._drain.target}'"
                )
                raise WorkerError(
                    grpc.StatusCode.UNAVAILABLE, f"worker {self.ctx.worker_id} is {doing}"
                )
            if method not in self.role.methods and method in self._served_by:
                raise WorkerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{method} needs a worker in role '{self._served_by[method]}'; worker "
                    f"{self.ctx.worker_id} is in role '{self.role.name}'",
                )
            self.role.dispatch(method, request, sink, timeout_s)  # UNIMPLEMENTED if unknown
        except WorkerError as err:
            sink.fail(err)

    def _step(self) -> None:
        started, cpu = time.monotonic(), time.thread_time()
        outputs = self.engine.step(self._before_forward)
        ended = time.monotonic()
        with delivered_together():  # one loop wake-up for the whole step's tokens
            self.role.on_outputs(outputs, started, ended)
            if self.metrics is not None:
                self.metrics.on_outputs(outputs)
        self._steps += 1  # wall and CPU both include handing the outputs to their sinks
        self._step_wall_s += time.monotonic() - started
        self._step_cpu_s += time.thread_time() - cpu

    def _poll_handoff(self) -> None:
        outcomes, results = self.handoff.poll()
        if outcomes:
            self.role.on_handoff(outcomes)
        if results and self.metrics is not None:
            self.metrics.on_transfers(results)

    def _before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        """The role's layer callback, then any between-layers RPCs that have arrived (roles
        without such RPCs get their own callback, nothing added per layer)."""
        role_callback = self.role.before_forward(scheduled)
        if not self.role.between_layers:
            return role_callback

        def on_layer_done(layer: int) -> None:
            if role_callback is not None:
                role_callback(layer)
            self._run_urgent()

        return on_layer_done

    # ---- draining and role switch ------------------------------------------------------------

    def _on_set_role(self, role: str, drain_timeout_s: float, sink: UnarySink) -> None:
        if role not in self.roles:
            sink.fail(
                WorkerError(
                    grpc.StatusCode.INVALID_ARGUMENT,
                    f"role must be one of {sorted(self.roles)}, got {role!r}",
                )
            )
        elif self._drain is not None:
            sink.fail(
                WorkerError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"worker {self.ctx.worker_id} is already draining",
                )
            )
        elif role == self.role.name:
            sink.set(None)
        else:
            timeout = drain_timeout_s if drain_timeout_s > 0 else math.inf
            self._begin_drain(role, time.monotonic() + timeout, sink)

    def _begin_drain(self, target: str | None, deadline: float, sink: UnarySink | None) -> None:
        if self._drain is not None:
            if target is None:  # stop overrides a role switch in progress
                if self._drain.sink is not None:
                    self._drain.sink.fail(
                        WorkerError(grpc.StatusCode.UNAVAILABLE, "worker is stopping")
                    )
                self._drain = _Drain(None, min(deadline, self._drain.deadline), None)
            return
        log.info("draining (target role %s)", target)
        self._drain = _Drain(target, deadline, sink)
        self.snapshot = self._make_snapshot()

    def _drain_progress(self) -> None:
        drain = self._drain
        if drain is None:
            return
        if self.role.num_active() + self.handoff.num_abandoned() > 0:
            if time.monotonic() >= drain.deadline and not drain.aborted:
                what = "stopping" if drain.target is None else f"switching to '{drain.target}'"
                self.role.abort_all(
                    WorkerError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"worker {self.ctx.worker_id} is {what} and its drain timeout passed",
                    )
                )
                drain.aborted = True
            return
        if drain.target is None:
            self._stopped.set()
            return
        self.engine.check_integrity()
        self.engine.reset_scheduler()
        self.role = self.roles[drain.target](self.ctx)
        self._drain = None
        log.info("role is now %s", drain.target)
        self.snapshot = self._make_snapshot()
        if drain.sink is not None:
            drain.sink.set(None)

    def _shutdown(self) -> None:
        """Close the transport; results of transfers it fails release their blocks."""
        self._stopped.set()
        self.handoff.close()
        self._poll_handoff()
        self.snapshot = self._make_snapshot()
        self._fail_queued()

    def _make_snapshot(self) -> Snapshot:
        sched = self.engine.scheduler
        waiting_tokens = sum(r.num_tokens for r in sched.waiting) + sum(
            r.num_tokens - r.num_computed_tokens for r in sched.running if not r.is_decoding
        )
        pool = self.engine.block_pool
        return Snapshot(
            role=self.role.name,
            draining=self._drain is not None,
            num_waiting=len(sched.waiting) + len(sched.ready) + self.handoff.num_reserved(),
            num_running=len(sched.running) + sched.num_parked(),
            waiting_tokens=waiting_tokens,
            free_blocks=pool.num_free,
            total_blocks=pool.num_blocks,
            block_size=self.engine.config.block_size,
            engine_steps=self._steps,
            engine_step_wall_s=self._step_wall_s,
            engine_step_cpu_s=self._step_cpu_s,
            num_receiving=self.handoff.num_receiving(),
        )
