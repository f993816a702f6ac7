"""`WorkerConfig`: everything one worker process is started with. Torch-free.

`WorkerSettings` holds what every worker of a cluster shares; it *is* the cluster config's
``[worker]`` table (`deploy.config.ClusterConfig.worker`), so a field added here is a cluster
key that reaches every worker under the same name. `WorkerConfig` adds what differs per
worker (id, role, addresses, model folder, engine, threads). Built from the cluster config in
one place (`deploy.config.ClusterConfig.worker_config`) and handed whole, as JSON, to the
worker process (`python -m worker_main --config FILE`, by `deploy.launcher`) or the Ray actor
(`deploy.ray_launcher`); a worker run by hand takes the same fields as flags
(`worker.cli`, derived from this model). Threads reach a worker one way: its `torch_threads`,
which the worker applies (`torch.set_num_threads`) and the launchers turn into the
environment the process starts with (`thread_env`).
"""

from __future__ import annotations

import uuid
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator

from model_runtime.engine_config import EngineConfig
from proto.pdserve.v1.roles import Role
from security.config import InternalTLS
from tracing.config import TracingConfig

READY_PREFIX = "PDSERVE_WORKER_READY"
"""Start of the one stdout line a worker prints once it serves (``... host:port``)."""


class WorkerSettings(BaseModel):
    """What every worker of a cluster shares: the cluster config's ``[worker]`` table
    (module docstring)."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Niceness to run at (raised at start, never lowered): on hosts where the "
        "router and Redis share CPUs with workers, their latency-critical work goes first.",
    )
    sched_idle: bool = Field(
        default=False,
        description="Run under SCHED_IDLE (Linux): the worker gets a CPU only when no "
        "normal-priority task wants it, so the router and Redis sharing its CPUs are never "
        "kept waiting by model compute. Stronger than `nice`; use it only on a host that serves "
        "nothing else, since any busy normal task starves the worker.",
    )
    kv_shared_memory: bool = Field(
        default=True,
        description="Keep the KV cache in shared memory and use the same-host data plane "
        "with peers that do too (CPU: memfd, kvtransfer.shm; CUDA: CUDA IPC on the same GPU, "
        "kvtransfer.cuda_ipc).",
    )
    kv_connect_timeout_s: float = Field(
        default=10.0, gt=0, description="Bound on joining a KV peer (never above a deadline)."
    )
    default_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Deadline of a request that carries neither timeout_s nor a gRPC deadline.",
    )
    stop_grace_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM (`python -m worker_main`): NOT_SERVING at once, no new work, "
        "in-flight requests get this long; the launchers wait as long for a worker to stop.",
    )


class WorkerConfig(WorkerSettings):
    """Everything one worker process is started with. Frozen; discovered values (bound ports,
    epoch, KV block count) live on `WorkerServer`, never here."""

    worker_id: str = Field(
        default_factory=lambda: f"worker-{uuid.uuid4().hex[:8]}",
        description="Unique id of this worker (no '/' or '@'); names it in tickets and logs.",
    )
    model_dir: Path = Field(description="HF model folder (config.json + safetensors).")
    role: Role = Field(description="Initial role; SetRole changes it without a restart.")
    engine: EngineConfig = Field(default_factory=EngineConfig, description="Engine sizing.")
    host: str = Field(default="127.0.0.1", description="gRPC bind address.")
    port: int = Field(default=0, ge=0, le=65535, description="gRPC port; 0 = pick a free one.")
    metrics_port: int | None = Field(
        default=0,
        ge=0,
        le=65535,
        description="Prometheus /metrics port on `host` (0 = pick a free one; None = no "
        "exporter); GetStatus reports the bound one.",
    )
    torch_threads: int | None = Field(
        default=None, gt=0, description="torch.set_num_threads; None keeps torch's default."
    )
    transfer_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Reservation lifetime and KV transfer deadline of a Reserve that carries "
        "no timeout_s (a routed Reserve always carries the request's remaining deadline).",
    )
    kv_host: str = Field(
        default="127.0.0.1", description="Address of this worker's KV transport (store + pairs)."
    )
    kv_port: int = Field(default=0, ge=0, le=65535, description="KV store port; 0 = pick.")
    node: str = Field(
        default="",
        description="Node label this worker reports (Ray's node id under the Ray launcher): "
        "the router prefers prefill/decode pairs on one node, and the shared-memory KV plane "
        "is used only between workers with equal labels ('' = unlabelled, one host).",
    )
    internal_tls: InternalTLS | None = Field(
        default=None,
        description="Serve the worker API over mutual TLS (the cluster certificate; clients "
        "must present one the same CA signed).",
    )
    insecure: bool = Field(
        default=False,
        description="Allow a non-loopback `host` without a cluster secret (the worker API and "
        "the KV rendezvous then answer anyone who can reach them).",
    )

    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry spans of this worker's RPCs (the cluster's [tracing]; unset "
        "keys from this process's OTEL_* environment); default off.",
    )

    @field_validator("worker_id")
    @classmethod
    def _check_worker_id(cls, v: str) -> str:
        if not v or "/" in v or "@" in v or any(c.isspace() for c in v):
            raise ValueError(f"worker_id must be non-empty without '/', '@' or spaces, got {v!r}")
        return v


THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
"""The thread pools a worker process sizes from its environment before any code runs."""


def thread_env(config: WorkerConfig) -> dict[str, str]:
    """The environment a worker process starts with for its `torch_threads` (OpenMP's and
    MKL's pools are sized when they start, before the worker can call
    `torch.set_num_threads`); empty when it keeps torch's default. Both launchers use it."""
    if config.torch_threads is None:
        return {}
    return {var: str(config.torch_threads) for var in THREAD_ENV_VARS}
