"""Processor sharing on a few cores, in virtual time: the simulator's CPU model. Pure.

Every busy entity (a worker's step, a worker's side threads, the host) wants some threads; with
`cores` set they all get min(1, cores / busy threads) of full speed, alike. So one *virtual*
clock — the work-seconds each busy entity has done — serves them all: an entity that starts w
seconds of work at virtual time v is done at v + w whatever the sharing does meanwhile, and a
heap of those ends gives the next one in O(log n). Real time relates to virtual time by the
current rate, which changes only when an entity starts or stops. `cores` None: no sharing (a
device per worker), rate 1.

**Contended multi-thread steps.** A step on several threads synchronizes them at every
parallel operation: while the cores are oversubscribed, a thread the OS has descheduled holds
the others at the next barrier, so the step turns only part of its share into progress
(`efficiency` < 1: `costs.CostModel.contended_eff`, fitted to served runs by
`fit_contention`). Such an entity cannot ride the common virtual clock: it keeps its own
remaining work, which advances at rate x efficiency while demand exceeds the cores and at full
speed otherwise. There are few of them (one per multi-thread worker), so they are scanned, not
heaped.
"""

from __future__ import annotations

import heapq
import math

from tooling.planner.sim_workers import Entity

EPS = 1e-9
DONE_S = 1e-9  # a contended entity with this little work left (seconds) is done


class SharedCpu:
    """The virtual clock, the heap of busy entities and the contended ones (module
    docstring)."""

    def __init__(self, cores: float | None) -> None:
        self.cores = cores
        self.vnow = 0.0
        self.demand = 0.0  # threads of the busy entities
        self._heap: list[tuple[float, int, int, Entity]] = []  # (virtual end, seq, version, w)
        self._seq = 0
        self._contended: list[Entity] = []  # busy entities with efficiency < 1

    def rate(self) -> float:
        c = self.cores
        return 1.0 if c is None or self.demand <= c else c / self.demand

    def _speed(self, w: Entity) -> float:
        """Work-seconds per real second of a contended entity now."""
        c = self.cores
        if c is None or self.demand <= c:
            return 1.0
        return self.rate() * w.efficiency

    def busy(self, w: Entity, work: float, threads: float, efficiency: float = 1.0) -> None:
        """`w` has `work` more seconds of full-speed work, on `threads` threads, turning
        `efficiency` of its share into progress while the cores are oversubscribed (kept from
        the work already in progress when `w` is busy)."""
        if not w.busy:
            w.busy, w.threads_busy = True, threads
            self.demand += threads
            w.efficiency = efficiency if self.cores is not None else 1.0
            if w.efficiency < 1.0:
                w.remaining = work
                self._contended.append(w)
                return
            w.finish_v = self.vnow + work
        elif w.efficiency < 1.0:
            w.remaining += work
            return
        else:
            w.finish_v += work
        w.version += 1
        self._seq += 1
        heapq.heappush(self._heap, (w.finish_v, self._seq, w.version, w))

    def cancel(self, w: Entity) -> None:
        """`w`'s work is dropped (an aborted step)."""
        if w.busy:
            self.demand -= w.threads_busy
            w.busy = False
            if w.efficiency < 1.0:
                self._contended.remove(w)
        w.version += 1

    def next_time(self, now: float) -> float:
        """Real time at which the next busy entity finishes (inf: none is busy)."""
        best = math.inf
        while self._heap:
            v, _, version, w = self._heap[0]
            if version == w.version and w.busy:
                best = now + max(0.0, v - self.vnow) / self.rate()
                break
            heapq.heappop(self._heap)
        for w in self._contended:
            best = min(best, now + max(0.0, w.remaining) / self._speed(w))
        return best

    def advance(self, dt: float) -> None:
        """`dt` real seconds pass at the current rate."""
        for w in self._contended:
            w.remaining -= dt * self._speed(w)
        self.vnow += dt * self.rate()

    def finished(self) -> list[Entity]:
        """The entities whose work is done at the current virtual time (now idle)."""
        out = [w for w in self._contended if w.remaining <= DONE_S]
        for w in out:
            self.cancel(w)
        while self._heap:
            v, _, version, w = self._heap[0]
            if version != w.version or not w.busy:
                heapq.heappop(self._heap)
                continue
            if v > self.vnow + EPS * max(1.0, self.vnow):
                break
            heapq.heappop(self._heap)
            self.cancel(w)
            out.append(w)
        return out
