"""A test hook that holds a worker's engine steps, so a test can keep a request in flight for as
long as it needs — a state, not a token count or a sleep. Runs in the worker's engine thread.

Off unless the worker's environment names a folder in `HOLD_DIR_ENV` (tests only; never set in
production). Then, before each engine step, the engine thread reads the file named after its
worker id in that folder (`hold_file`):

- no file: steps run;
- a file holding a number N: steps run while the worker has run fewer than N steps in all
  (`WorkerStatus.engine_steps`), then hold — a test that read the count lets a request run a
  given number of steps and stop there;
- any other content (an empty file): steps hold.

While held, the engine thread still takes commands (RPCs, aborts, role changes, drains),
expires deadlines and polls KV transfers — everything but the model; the requests it runs stay
where they are. Removing the file releases it. `hold` / `release` write and remove the file
(from the test's side, any process).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Protocol

HOLD_DIR_ENV = "PDSERVE_TEST_HOLD_DIR"


class StepGate(Protocol):
    """Whether the engine thread may run its next step, having run `steps` so far."""

    def allows(self, steps: int) -> bool: ...


class OpenGate:
    """Every step runs (production)."""

    def allows(self, steps: int) -> bool:
        return True


class FileGate:
    """The file-controlled gate of the module docstring, for one worker."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def allows(self, steps: int) -> bool:
        try:
            text = self.path.read_text().strip()
        except FileNotFoundError:
            return True
        except OSError:  # being rewritten: hold this once, read it again next iteration
            return False
        return text.isdigit() and steps < int(text)


def hold_file(folder: Path, worker_id: str) -> Path:
    """The file that holds worker `worker_id` (its id with path separators replaced)."""
    return folder / worker_id.replace(os.sep, "_")


def gate_from_env(worker_id: str) -> StepGate:
    """`FileGate` for this worker when `HOLD_DIR_ENV` is set, else `OpenGate`."""
    folder = os.environ.get(HOLD_DIR_ENV)
    return OpenGate() if not folder else FileGate(hold_file(Path(folder), worker_id))


def hold(folder: Path, worker_id: str, until_steps: int | None = None) -> None:
    """Hold worker `worker_id`'s steps now, or once it has run `until_steps` in all. Written
    whole and renamed into place: the engine thread never reads half a file."""
    path = hold_file(folder, worker_id)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("" if until_steps is None else str(until_steps))
    tmp.replace(path)


def release(folder: Path, worker_id: str) -> None:
    """Let worker `worker_id` step again."""
    hold_file(folder, worker_id).unlink(missing_ok=True)
