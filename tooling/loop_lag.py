"""Measure how long an asyncio event loop stalls. Runs inside the process whose loop it watches
(tests and benchmarks of the router's HTTP front).

`LoopWatchdog` is a task that asks to wake every `tick_s` and records how late each wake-up was.
A wake-up that comes late means the loop was busy with something else (a stall) — or that the
whole process was not scheduled, which on a shared machine says nothing about the code. So each
lateness is recorded twice:

- `max_wall_s`: the wall-clock lateness;
- `max_stall_s`: the part of it the process spent on the CPU (``time.process_time``, all its
  threads), i.e. ``min(wall lateness, process CPU time in the same interval)``. A stall caused by
  work the process did (parsing, rendering, tokenizing, on the loop or in a thread holding the
  GIL) costs process CPU time; a stretch where the OS ran other processes does not.

The two agree on an idle machine; on a busy one `max_stall_s` is the number that describes the
code.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field


@dataclass
class LoopWatchdog:
    """A ticker on the running loop (module docstring). `start()` inside the loop, `stop()` to
    end it; the maxima are readable at any time."""

    tick_s: float = 0.005
    max_wall_s: float = 0.0
    max_stall_s: float = 0.0
    ticks: int = 0
    _task: asyncio.Task[None] | None = field(default=None, repr=False)

    def start(self) -> None:
        """Start ticking on the running loop."""
        assert self._task is None, "watchdog already started"
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-watchdog")

    def reset(self) -> None:
        """Forget the maxima so far (e.g. after a warm-up)."""
        self.max_wall_s = self.max_stall_s = 0.0
        self.ticks = 0

    async def stop(self) -> None:
        """Stop ticking (idempotent)."""
        if self._task is None:
            return
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def _run(self) -> None:
        while True:
            wall0, cpu0 = time.perf_counter(), time.process_time()
            await asyncio.sleep(self.tick_s)
            late = time.perf_counter() - wall0 - self.tick_s
            cpu = time.process_time() - cpu0
            self.ticks += 1
            self.max_wall_s = max(self.max_wall_s, late)
            self.max_stall_s = max(self.max_stall_s, min(late, cpu))
