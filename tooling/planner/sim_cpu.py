"""Processor sharing on a few cores, in virtual time: the simulator's CPU model. Pure.

Every busy entity (a worker's step, a worker's side threads, the host) wants some threads; with
`cores` set they all advance at min(1, cores / busy threads) of full speed, alike. So one
*virtual* clock — the work-seconds each busy entity has done — serves them all: an entity that
starts w seconds of work at virtual time v is done at v + w whatever the sharing does meanwhile,
and a heap of those ends gives the next one in O(log n). Real time relates to virtual time by
the current rate, which changes only when an entity starts or stops. `cores` None: no sharing
(a device per worker), rate 1.
"""

from __future__ import annotations

import heapq
import math

from tooling.planner.sim_workers import Entity

EPS = 1e-9


class SharedCpu:
    """The virtual clock and the heap of busy entities (module docstring)."""

    def __init__(self, cores: float | None) -> None:
        self.cores = cores
        self.vnow = 0.0
        self.demand = 0.0  # threads of the busy entities
        self._heap: list[tuple[float, int, int, Entity]] = []  # (virtual end, seq, version, w)
        self._seq = 0

    def rate(self) -> float:
        c = self.cores
        return 1.0 if c is None or self.demand <= c else c / self.demand

    def busy(self, w: Entity, work: float, threads: float) -> None:
        """`w` has `work` more seconds of full-speed work, on `threads` threads."""
        if not w.busy:
            w.busy, w.threads_busy = True, threads
            w.finish_v = self.vnow + work
            self.demand += threads
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
        w.version += 1

    def next_time(self, now: float) -> float:
        """Real time at which the next busy entity finishes (inf: none is busy)."""
        while self._heap:
            v, _, version, w = self._heap[0]
            if version == w.version and w.busy:
                return now + max(0.0, v - self.vnow) / self.rate()
            heapq.heappop(self._heap)
        return math.inf

    def advance(self, dt: float) -> None:
        """`dt` real seconds pass at the current rate."""
        self.vnow += dt * self.rate()

    def finished(self) -> list[Entity]:
        """The entities whose work is done at the current virtual time (now idle)."""
        out = []
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
