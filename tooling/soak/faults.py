"""The fault injector: carries out a plan's faults at their times against a `SoakCluster` and
records what it did. Runs in the soak process, on its event loop, beside the load.

- `kill-prefill` / `kill-decode`: SIGKILL the target's process (its pid from the launcher's
  handle); a watcher then waits for the worker to serve again with a new epoch (the launcher's
  restart) and records when (`rejoined_s`);
- `stop`, `long-stop`: SIGSTOP, sleep the fault's duration, SIGCONT (only if the pid still is
  that worker's: no signal to a reused pid);
- `redis`: SIGKILL redis-server, leave it down 0.5..3 s, start an empty one on the same port;
- `kv-stall`: waits for its probe request (a long prompt with a short deadline) to be sent,
  polls every decode worker's free blocks, and SIGSTOPs the one whose free blocks dropped by the
  probe's reservation: the KV transfer into it stalls until after the probe's deadline, and it
  is resumed half a second after that. If no decode worker shows the reservation within 1 s, a
  random one is stopped just as long (recorded as `guessed`).

Every stopped process is resumed on the way out, whatever happened (`SoakCluster.stop`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from tooling.soak.cluster import SoakCluster
from tooling.soak.config import STOP_KINDS
from tooling.soak.workload import PROBE_PROMPT, PROBE_TIMEOUT_S, PlannedFault, PlannedRequest

log = logging.getLogger(__name__)
POLL_S = 0.25


@dataclass
class FaultRecord:
    """What one fault did. Times are seconds after the load started."""

    index: int
    kind: str
    time_s: float
    target: str
    duration_s: float = 0.0
    pid: int | None = None
    old_epoch: int | None = None
    detail: str = ""
    rejoined_s: float | None = None  # kills: when the worker served again, new epoch
    probe: int | None = None  # kv-stall: the probe request's index

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["old_epoch"] = str(self.old_epoch) if self.old_epoch is not None else None
        return out


@dataclass
class Injector:
    cluster: SoakCluster
    faults: tuple[PlannedFault, ...]
    t0: float
    seed: int
    block_size: int = 16
    records: list[FaultRecord] = field(default_factory=list)
    _probes: dict[int, asyncio.Event] = field(default_factory=dict)
    _tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed + 1)
        for f in self.faults:
            if f.probe is not None:
                self._probes[f.probe] = asyncio.Event()

    def now(self) -> float:
        return time.monotonic() - self.t0

    def on_sent(self, r: PlannedRequest) -> None:
        """Load-runner hook: a probe was just sent."""
        if r.index in self._probes:
            self._probes[r.index].set()

    async def run(self) -> None:
        """Start each fault at its time (faults overlap: each runs in its own task); return once
        every fault and every rejoin watcher is done."""
        for f in self.faults:
            if f.kind != "kv-stall":
                delay = f.at_s - self.now()
                if delay > 0:
                    await asyncio.sleep(delay)
            self._spawn(self._inject(f), f"fault-{f.index}")
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _inject(self, f: PlannedFault) -> None:
        try:
            if f.kind in ("kill-prefill", "kill-decode"):
                await self._kill(f)
            elif f.kind in STOP_KINDS:
                await self._stop(f)
            elif f.kind == "redis":
                await self._redis(f)
            else:
                await self._kv_stall(f)
        except Exception as exc:  # recorded in the report: an injector bug must not pass quietly
            log.exception("fault %d (%s) failed", f.index, f.kind)
            self.records.append(FaultRecord(f.index, f.kind, self.now(), "?", detail=repr(exc)))

    async def _kill(self, f: PlannedFault) -> None:
        role = "prefill" if f.kind == "kill-prefill" else "decode"
        ref = self.cluster.refs(role)[f.target]
        pid = await self.cluster.worker_pid(ref.worker_id)
        view = self.cluster.router_views().get(ref.address)
        rec = FaultRecord(f.index, f.kind, self.now(), ref.worker_id, pid=pid)
        rec.old_epoch = view.epoch if view is not None and view.epoch else None
        self.records.append(rec)
        if pid is None or not self.cluster.send_signal(pid, signal.SIGKILL):
            rec.detail = "skipped: no live process (not restarted yet)"
            return
        rec.detail = f"SIGKILL pid {pid}"
        await self._watch_rejoin(rec)

    async def _watch_rejoin(self, rec: FaultRecord, timeout_s: float = 120.0) -> None:
        """Until the worker answers GetStatus with a new epoch and the router sees it healthy."""
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            await asyncio.sleep(POLL_S)
            ref = next(w for w in self.cluster.refs() if w.worker_id == rec.target)
            st = await self.cluster.status(ref.address, timeout_s=0.5)
            view = self.cluster.router_views().get(ref.address)
            if st is None or st.epoch == (rec.old_epoch or 0):
                continue
            if view is not None and view.healthy and view.epoch == st.epoch:
                rec.rejoined_s = self.now()
                return
        rec.detail += f"; not serving again after {timeout_s:.0f} s"

    async def _stop(self, f: PlannedFault) -> None:
        ref = self.cluster.refs()[f.target]
        pid = await self.cluster.worker_pid(ref.worker_id)
        rec = FaultRecord(f.index, f.kind, self.now(), ref.worker_id, f.duration_s, pid)
        self.records.append(rec)
        if pid is None or not self.cluster.send_signal(pid, signal.SIGSTOP):
            rec.detail = "skipped: no live process"
            return
        rec.detail = f"SIGSTOP pid {pid} for {f.duration_s:.1f} s"
        await self._resume_later(ref.worker_id, pid, f.duration_s)

    async def _resume_later(self, worker_id: str, pid: int, after_s: float) -> None:
        """SIGCONT after `after_s` (never to a process that replaced the stopped one: a stopped
        process cannot be asked who it is, so `SoakCluster.resume` checks its start time)."""
        try:
            await asyncio.sleep(after_s)
        finally:
            if not self.cluster.resume(pid):
                log.info("%s (pid %d) was gone before its SIGCONT", worker_id, pid)

    async def _redis(self, f: PlannedFault) -> None:
        down = self._rng.uniform(0.5, 3.0)
        rec = FaultRecord(f.index, f.kind, self.now(), "redis", down, self.cluster.redis.pid)
        self.records.append(rec)
        await asyncio.to_thread(self.cluster.redis.kill)
        await asyncio.sleep(down)
        await asyncio.to_thread(self.cluster.redis.start)
        rec.detail = f"SIGKILL, down {down:.1f} s, restarted empty (pid {self.cluster.redis.pid})"

    async def _kv_stall(self, f: PlannedFault) -> None:
        assert f.probe is not None
        sent = self._probes[f.probe]
        decodes = self.cluster.refs("decode")
        before = {d.address: await self._free(d.address) for d in decodes}
        await sent.wait()
        t_sent = self.now()
        need = -(-(PROBE_PROMPT + 8 - 1) // self.block_size)
        target, how = None, "guessed"
        end = time.monotonic() + 1.0
        while target is None and time.monotonic() < end:
            for d in decodes:
                free = await self._free(d.address)
                start = before[d.address]
                if free is None or start is None:
                    continue
                if start - free >= need:
                    target, how = d, "reservation seen"
                    break
                before[d.address] = max(start, free)
            await asyncio.sleep(0.002)
        if target is None:  # not seen (the probe may have been refused): stop one anyway
            target = self._rng.choice(decodes)
            t_sent = self.now()
        pid = await self.cluster.worker_pid(target.worker_id)
        stall = max(0.5, t_sent + PROBE_TIMEOUT_S + 0.5 - self.now())
        rec = FaultRecord(f.index, f.kind, self.now(), target.worker_id, stall, pid)
        rec.detail = f"probe request {f.probe}; target {how}"
        rec.probe = f.probe
        self.records.append(rec)
        if pid is None or not self.cluster.send_signal(pid, signal.SIGSTOP):
            rec.detail += "; skipped: no live process"
            return
        await self._resume_later(target.worker_id, pid, stall)

    async def _free(self, address: str) -> int | None:
        st = await self.cluster.status(address, timeout_s=0.3)
        return None if st is None else int(st.free_blocks)

    async def cancel(self) -> None:
        """Stop every fault task now (stopped processes are resumed by their tasks)."""
        for t in list(self._tasks):
            t.cancel()
        for t in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await t
