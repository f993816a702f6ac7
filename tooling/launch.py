"""The cluster launcher as tooling sees it: a parameter, never an import.

Runs in whatever process drives a benchmark, a calibration or a soak. Tooling sits below
`deploy` (`pdserve bench / plan / profile / soak` are deploy's commands and import tooling),
so tooling never imports deploy: the code that starts clusters takes a launch function, and
deploy's commands, the tests and the benchmarks pass `deploy.tool_launchers.launch_cluster` /
`launch_workers`. A launch function takes dotted cluster-config overrides (the keys of
`pdserve up --set`, e.g. `{"model": ..., "workers.decode": 2}`) and a log folder, validates
them (ValueError / pydantic ValidationError naming the field) and returns once every process
serves.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from router.config import RouterConfig
from security.channels import InternalAuth


@dataclass(frozen=True)
class WorkerRef:
    """A launched worker: its id, its role at launch, its address."""

    worker_id: str
    role: str
    address: str


class Cluster(Protocol):
    """Workers and a router, all local processes, serving. `stop()` ends every one (by PID)."""

    @property
    def address(self) -> str:
        """The router's gRPC host:port."""
        ...

    @property
    def http_url(self) -> str | None:
        """The router's OpenAI HTTP base URL (``http://host:port/v1``); None without a front."""
        ...

    def members(self) -> list[WorkerRef]:
        """The workers, in launch order."""
        ...

    def labelled_pids(self) -> dict[str, int]:
        """{"router": pid, <worker id>: pid, ...} now (a restarted worker has a new pid)."""
        ...

    def effective_config(self) -> dict[str, Any]:
        """The validated cluster config, as JSON-able data."""
        ...

    def stop(self, grace_s: float | None = None) -> None: ...


class Workers(Protocol):
    """Supervised workers without a router (the caller runs one: `router_config`): what every
    launcher hands back (deploy's process and Ray launchers, `deploy.launchers`)."""

    @property
    def internal(self) -> InternalAuth:
        """How to call the workers (the cluster secret's token, the cluster certificate)."""
        ...

    @property
    def router_config(self) -> RouterConfig:
        """The config of a router in front of these workers."""
        ...

    def addresses(self) -> dict[str, list[str]]:
        """role -> worker addresses, as launched (roles can change later via SetRole)."""
        ...

    def members(self) -> list[WorkerRef]:
        """The workers, in launch order."""
        ...

    def pids(self) -> list[int]:
        """The workers' process ids (a restarted worker has a new one)."""
        ...

    def live_pid(self, worker_id: str) -> int | None:
        """The process id running `worker_id` now; None while none runs (blocking: a Ray
        worker is asked, with a short timeout)."""
        ...

    def stop(self, grace_s: float | None = None) -> None:
        """Stop supervising and stop every worker (each drains for up to `grace_s`, default
        its drain timeout); idempotent."""
        ...


C = TypeVar("C", bound=Cluster)

LaunchCluster = Callable[[Mapping[str, Any], Path], C]
"""(overrides, log folder) -> a serving `Cluster` (router + workers as local processes)."""

LaunchWorkers = Callable[[Mapping[str, Any], Path], Workers]
"""(overrides, log folder) -> serving `Workers` (processes or Ray actors, by `launcher`)."""
