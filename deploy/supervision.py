"""Worker supervision shared by both launchers: the event log, restart backoff, role coverage.

Runs in the launching process (`pdserve up`, test fixtures). The process launcher's
`ProcessSupervisor` (below) and the Ray launcher's supervisor thread both report what they
see here, so an operator reads one vocabulary whichever launcher runs the workers:

- ``died``: a worker process ended (a signal, or an exit status other than 0);
  ``restarting``: a restart is scheduled (after a backoff); ``restarted``: it serves again (new
  pid, same address, new epoch); ``restart_failed``: a restart attempt did not come up;
  ``gave_up``: no more restarts (the worker stays down); ``stopped``: the worker exited 0,
  which a worker does only after a stop it was asked for (SIGTERM or SIGINT: it drained
  first, `worker.cli`) — an operator's drain, so it stays down (never restarted) until
  `ProcessSupervisor.resume`;
- ``role_down`` / ``role_up``: the last live worker of a role went away / one came back. While a
  role is down the router answers UNAVAILABLE and its health says NOT_SERVING.

Every event is logged (deaths and role changes at WARNING / ERROR) and passed to the optional
`on_event` callback (`pdserve up` prints them).
"""

from __future__ import annotations

import logging
import re
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from deploy.processes import ManagedProcess, stop_processes

log = logging.getLogger(__name__)

EVENT_KINDS = frozenset(
    {
        "died",
        "stopped",
        "restarting",
        "restarted",
        "restart_failed",
        "gave_up",
        "role_down",
        "role_up",
    }
)
# A worker's exit status after a stop it was asked for (`worker.cli.main`); anything else
# (another status, a signal) is a crash.
STOPPED_ON_REQUEST = 0


class SupervisionConfig(BaseModel):
    """How the process launcher restarts dead workers (`[supervision]` in a cluster TOML; the
    Ray launcher restarts through Ray, `ray.max_restarts`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_restarts: int = Field(
        default=5,
        ge=0,
        description="Restarts in a row (each died or failed within `stable_s` of its start) "
        "before a worker is given up; 0 = never restart.",
    )
    backoff_s: float = Field(
        default=0.5, gt=0, description="Wait before the first restart of a worker that died."
    )
    max_backoff_s: float = Field(
        default=10.0, gt=0, description="The wait doubles per restart in a row, up to this."
    )
    stable_s: float = Field(
        default=10.0,
        gt=0,
        description="A worker that ran this long before dying starts over at `backoff_s`.",
    )
    check_interval_s: float = Field(
        default=0.1, gt=0, description="How often the supervisor looks at its children."
    )
    start_timeout_s: float = Field(
        default=120.0, gt=0, description="Longest wait for a restarted worker's READY line."
    )

    def backoff(self, in_a_row: int) -> float:
        """Seconds to wait before restart number `in_a_row` (1, 2, ...) of a worker."""
        return float(min(self.max_backoff_s, self.backoff_s * 2 ** max(0, in_a_row - 1)))


@dataclass(frozen=True)
class SupervisionEvent:
    """Something a supervisor saw (`kind` in `EVENT_KINDS`); `worker_id` is the role's name
    for ``role_down`` / ``role_up``."""

    worker_id: str
    kind: str
    detail: str
    at: float = field(default_factory=time.time)


def exit_text(returncode: int) -> str:
    """How a child ended, in words: "killed by SIGKILL" or "exited with status 3"."""
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exited with status {returncode}"


_LEVELS = {"died": logging.WARNING, "gave_up": logging.ERROR, "role_down": logging.ERROR}


class EventLog:
    """Thread-safe list of `SupervisionEvent`s plus the live-role bookkeeping.

    `record` appends, logs and calls `on_event` (exceptions from it are logged, never raised
    into the supervisor). `roles_now(live)` emits ``role_down`` / ``role_up`` when the set of
    roles with a live worker changes."""

    def __init__(
        self,
        roles: Iterable[str],
        on_event: Callable[[SupervisionEvent], None] | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._events: list[SupervisionEvent] = []
        self._roles = sorted(set(roles))
        self._down: set[str] = set()
        self.on_event = on_event

    @property
    def events(self) -> list[SupervisionEvent]:
        """A copy of every event so far, oldest first."""
        with self._lock:
            return list(self._events)

    def record(self, worker_id: str, kind: str, detail: str) -> SupervisionEvent:
        assert kind in EVENT_KINDS, kind
        event = SupervisionEvent(worker_id, kind, detail)
        with self._lock:
            self._events.append(event)
        log.log(_LEVELS.get(kind, logging.INFO), "worker %s %s: %s", worker_id, kind, detail)
        if self.on_event is not None:
            try:
                self.on_event(event)
            except Exception:  # a broken printer must not stop supervision
                log.exception("supervision event callback failed")
        return event

    def roles_now(self, live: dict[str, int]) -> None:
        """`live`: role -> live workers now (roles not launched are ignored). Record the roles
        that just lost their last live worker (``role_down``) or got one back (``role_up``)."""
        with self._lock:
            went_down = [r for r in self._roles if live.get(r, 0) == 0 and r not in self._down]
            came_up = [r for r in self._roles if live.get(r, 0) > 0 and r in self._down]
            self._down.update(went_down)
            self._down.difference_update(came_up)
        for role in went_down:
            self.record(
                role,
                "role_down",
                f"no live {role} worker left: the cluster cannot serve until one is back "
                "(router health NOT_SERVING)",
            )
        for role in came_up:
            self.record(role, "role_up", f"{live[role]} live {role} worker(s) again")

    @property
    def roles_down(self) -> list[str]:
        """Roles with no live worker now."""
        with self._lock:
            return sorted(self._down)


class Supervised(Protocol):
    """A worker the process supervisor watches (`deploy.launcher.LaunchedWorker`); the
    supervisor replaces `process` when it restarts the worker."""

    process: ManagedProcess

    @property
    def worker_id(self) -> str: ...

    @property
    def role(self) -> str: ...

    @property
    def address(self) -> str: ...


_State = Literal["running", "stopped", "backoff", "starting", "given_up"]


@dataclass
class _Watch:
    """The supervisor's state of one worker (explicit states, no flags)."""

    worker: Supervised
    state: _State = "running"
    started: float = field(default_factory=time.monotonic)
    in_a_row: int = 0  # restarts since the worker last ran `stable_s`
    until: float = 0.0  # backoff: when to restart; starting: when to give the attempt up
    attempt: ManagedProcess | None = None  # starting: the new process


class ProcessSupervisor:
    """Watches local worker processes on one daemon thread: reaps each one that dies (no
    zombies), logs how it ended, restarts it with backoff on its old address (`respawn` gives
    the new process; it announces `ready` when it serves) and gives it up after
    `config.max_restarts` restarts in a row. A worker that exited `STOPPED_ON_REQUEST` was
    drained on purpose: it stays down until `resume`. `stop()` ends the thread and returns
    the processes it was starting, for the caller to stop."""

    def __init__(
        self,
        workers: Iterable[Supervised],
        config: SupervisionConfig,
        respawn: Callable[[Supervised, int], ManagedProcess],
        ready: re.Pattern[str],
        events: EventLog,
    ) -> None:
        self.config = config
        self.events = events
        self._respawn = respawn
        self._ready = ready
        self._watches = [_Watch(w) for w in workers]
        self._restarts = 0
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdserve-supervisor", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> list[ManagedProcess]:
        """Stop watching (idempotent); the half-started processes, which the caller stops."""
        self._stopped.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10.0)
        with self._lock:
            return [w.attempt for w in self._watches if w.attempt is not None]

    def resume(self, worker_id: str) -> None:
        """Start again a worker that stopped on request (after the usual first backoff);
        ValueError when `worker_id` is unknown or not stopped."""
        with self._lock:
            watch = next((w for w in self._watches if w.worker.worker_id == worker_id), None)
            if watch is None or watch.state != "stopped":
                state = "unknown" if watch is None else watch.state
                raise ValueError(f"resume: worker {worker_id!r} is {state}, not stopped")
            watch.in_a_row = 0
            self._schedule(watch, time.monotonic())

    def _run(self) -> None:
        while not self._stopped.wait(self.config.check_interval_s):
            try:
                with self._lock:
                    for watch in self._watches:
                        self._step(watch, time.monotonic())
                    live: dict[str, int] = {}
                    for watch in self._watches:
                        n = 1 if watch.state == "running" else 0
                        live[watch.worker.role] = live.get(watch.worker.role, 0) + n
                self.events.roles_now(live)
            except Exception:  # a dead supervisor would leave every later death unnoticed
                log.exception("supervisor round failed")

    def _step(self, watch: _Watch, now: float) -> None:
        w, cfg = watch.worker, self.config
        if watch.state == "running":
            code = w.process.popen.poll()  # reaps a dead child
            if code is not None:
                stop_processes([w.process], grace_s=0.0)  # already reaped: only forgets it
                ran = now - watch.started
                if code == STOPPED_ON_REQUEST:
                    watch.state = "stopped"
                    self.events.record(
                        w.worker_id,
                        "stopped",
                        f"pid {w.process.pid} stopped on request ({exit_text(code)}) after "
                        f"{ran:.1f} s; it stays down",
                    )
                    return
                self.events.record(
                    w.worker_id, "died", f"pid {w.process.pid} {exit_text(code)} after {ran:.1f} s"
                )
                watch.in_a_row = 0 if ran >= cfg.stable_s else watch.in_a_row
                self._schedule(watch, now)
        elif watch.state == "backoff" and now >= watch.until:
            self._restarts += 1
            watch.attempt = self._respawn(w, self._restarts)
            watch.state, watch.until = "starting", now + cfg.start_timeout_s
        elif watch.state == "starting":
            self._check_start(watch, now)

    def _schedule(self, watch: _Watch, now: float) -> None:
        """A restart after the backoff, or give up after `max_restarts` in a row."""
        watch.in_a_row += 1
        if watch.in_a_row > self.config.max_restarts:
            watch.state = "given_up"
            self.events.record(
                watch.worker.worker_id,
                "gave_up",
                f"{self.config.max_restarts} restarts in a row used (supervision.max_restarts); "
                "it stays down",
            )
            return
        delay = self.config.backoff(watch.in_a_row)
        watch.state, watch.until = "backoff", now + delay
        self.events.record(
            watch.worker.worker_id,
            "restarting",
            f"restart {watch.in_a_row} of at most {self.config.max_restarts} in {delay:.1f} s "
            f"on {watch.worker.address}",
        )

    def _check_start(self, watch: _Watch, now: float) -> None:
        proc, w = watch.attempt, watch.worker
        assert proc is not None, "starting without a process"
        m = self._ready.search(proc.log_text())
        if m and m.group(1) == w.address:
            old = w.process.pid
            w.process, watch.attempt = proc, None
            watch.state, watch.started = "running", now
            self.events.record(w.worker_id, "restarted", f"pid {old} -> {proc.pid} on {w.address}")
            return
        code = proc.popen.poll()
        if m is None and code is None and now < watch.until:
            return  # still loading
        if code is None:
            stop_processes([proc], grace_s=2.0)
        why = (
            f"announced {m.group(1)}, not {w.address}"
            if m
            else f"{exit_text(code)} before it was ready"
            if code is not None
            else f"not ready after {self.config.start_timeout_s:.0f} s"
        )
        self.events.record(w.worker_id, "restart_failed", f"{why}; log {proc.log_path}")
        watch.attempt = None
        self._schedule(watch, now)
