"""Cluster configuration for `pdserve up` (`ClusterConfig`), loaded from TOML.

Runs in the CLI process (`pdserve up`) and in test fixtures. One frozen pydantic v2 model with a
sub-model per TOML table; every field is described and defaulted where a default makes sense::

    model = "models/small"        # HF model folder, relative to the current directory
    mode = "disagg"               # or "colocated"
    launcher = "ray"              # or "process" (plain subprocesses, `--no-ray`)
    torch_threads = 1             # torch intra-op threads per worker process
    worker_nice = 0               # workers' niceness (0-19): router/Redis first on shared CPUs
    worker_sched_idle = false     # workers run only when router/Redis leave CPU (SCHED_IDLE)

    [workers]                     # counts; unset ones default from `mode`
    prefill = 1
    decode = 1

    [ray]      address = ""  num_cpus = 4  cpus_per_worker = 1  gpus_per_worker = 0
    [router]   host = "127.0.0.1"  port = 50051  http_port = 8000  policy = "prefix_aware" ...
    [router.prefix_index]  kind = "redis"  url = "redis://127.0.0.1:6380/0"   (default: memory)
    [router.hybrid]  local_prefill_max_tokens = 256  prefill_queue_max_tokens = 0 ...
               (a `router.hybrid` HybridConfig: decode workers prefill short prompts; default off)
    [engine]   block_size = 16  num_kv_blocks = 1024 ...        (a `model_runtime` EngineConfig)
    [transfer] timeout_s = 30  kv_host = "auto"
    [ratio]    mode = "adaptive"  slo_ttft_ms = 2000  slo_tpot_ms = 100  max_prefill = 2 ...
               (a `router.ratio` RatioConfig; default mode "fixed": the ratio never changes)
    [supervision]  max_restarts = 5  backoff_s = 0.5 ...   (process launcher's restarts)
    [security] tls_cert = "server.pem"  tls_key = "server.key"  auth_token_file = "tokens.txt"
               tls_client_ca = ...  metrics_public = false  insecure = false
               cluster_secret_file = ...   (a `security.config` SecurityConfig: file paths)
    [security.internal]  tls_cert = ...  tls_key = ...  tls_ca = ...   (router<->worker mTLS)
    [tracing]  enabled = true  endpoint = "http://jaeger:4317"  sampler_arg = 0.1 ...
               (a `tracing` TracingConfig: OpenTelemetry traces; unset keys from OTEL_* env)

`load_cluster_config(path, overrides)` reads the file, applies dotted-key overrides (CLI flags,
e.g. ``{"workers.prefill": 2, "ray.address": "auto"}``) and validates the result; every error
names the offending field by its dotted TOML path. Nothing discovered at start-up (ports, worker
addresses, KV block counts) is written back into a config: the launchers return it separately.

Importing this module imports torch (through `EngineConfig`); the CLI imports it only inside
the subcommands that need it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from deploy.supervision import SupervisionConfig
from model_runtime.engine_config import EngineConfig
from proto.pdserve.v1.roles import ROLE_NAMES, Role
from router.config import RouterConfig, RouterSettings
from router.ratio.config import RatioConfig
from security.config import SecurityConfig
from tracing.config import TracingConfig
from worker.config import WorkerConfig

Mode = Literal["disagg", "colocated"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class WorkerCounts(_Frozen):
    """How many worker processes of each role. Unset counts default from `mode`: disagg ->
    1 prefill + 1 decode, colocated -> 1 colocated; the other roles default to 0."""

    prefill: int = Field(default=0, ge=0, description="Prefill workers (mode 'disagg').")
    decode: int = Field(default=0, ge=0, description="Decode workers (mode 'disagg').")
    colocated: int = Field(default=0, ge=0, description="Colocated workers (mode 'colocated').")


class RaySection(_Frozen):
    """Where and how Ray places the worker actors (ignored by the process launcher)."""

    address: str = Field(
        default="",
        description="Ray cluster to join ('auto', 'ray://host:10001', 'host:6379'); empty starts "
        "a local cluster that `pdserve up` also shuts down.",
    )
    num_cpus: int | None = Field(
        default=None,
        ge=1,
        description="CPUs of the local cluster started when `address` is empty; None = all.",
    )
    cpus_per_worker: float = Field(
        default=1.0, gt=0, description="CPUs reserved for each worker actor (placement bundle)."
    )
    gpus_per_worker: float = Field(
        default=0.0,
        ge=0,
        description="GPUs reserved for each worker actor; 1 on GPU machines (with engine.device "
        "'cuda'), 0 on CPU-only ones.",
    )
    placement_strategy: Literal["auto", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = Field(
        default="auto",
        description="Placement-group strategy; 'auto' = PACK on a one-node cluster, else SPREAD.",
    )
    max_restarts: int = Field(
        default=1,
        ge=0,
        description="Times Ray restarts a worker actor that died (same node and port).",
    )
    start_timeout_s: float = Field(
        default=180.0,
        gt=0,
        description="Longest wait for placement and for every worker to report SERVING.",
    )


class RouterSection(RouterSettings):
    """The ``[router]`` table: the router's own settings (`router.config.RouterSettings`,
    every field and nested section of it, not re-declared here). Only the public port's
    default differs: a cluster's router listens on 50051 unless told otherwise. `pdserve up`
    runs this router inside its own process."""

    port: int = Field(default=50051, ge=0, le=65535, description="Public port; 0 picks one.")


class TransferSection(_Frozen):
    """KV hand-off between prefill and decode workers."""

    timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for one request's KV transfer."
    )
    kv_host: str = Field(
        default="auto",
        description="Address decode workers advertise for KV rendezvous; 'auto' = the worker "
        "host (127.0.0.1 locally, the node IP on an external Ray cluster).",
    )
    shared_memory: bool = Field(
        default=True,
        description="Same-host data plane: a decode worker copies the KV blocks straight out "
        "of the prefill worker's cache (CPU: shared memory; CUDA: CUDA IPC on the same GPU) "
        "instead of receiving them over gloo / NCCL; other pairs fall back by themselves.",
    )


class ClusterConfig(_Frozen):
    """Everything `pdserve up` needs: model, topology, placement, router, engine, transfer."""

    model: Path = Field(description="HF model folder (config.json, safetensors, tokenizer.json).")
    mode: Mode = Field(default="disagg", description="'disagg' (prefill + decode) or 'colocated'.")
    launcher: Literal["ray", "process"] = Field(
        default="ray",
        description="'ray' = worker actors in placement groups; 'process' = local subprocesses.",
    )
    workers: WorkerCounts = Field(
        default_factory=WorkerCounts, description="Worker processes per role."
    )
    torch_threads: int = Field(default=1, ge=1, description="torch threads per worker process.")
    drain_timeout_s: float = Field(
        default=30.0,
        ge=0,
        description="On SIGTERM a worker says NOT_SERVING and lets its requests run this long "
        "(the rest are moved to another worker), then exits.",
    )
    worker_nice: int = Field(
        default=0,
        ge=0,
        le=19,
        description="Niceness of every worker process: above 0, the router and Redis sharing "
        "their CPUs get them first (worker compute yields on wake-ups).",
    )
    worker_sched_idle: bool = Field(
        default=False,
        description="Run every worker under SCHED_IDLE: it gets a CPU only when no "
        "normal-priority task wants one, so the router and Redis never wait for model compute. "
        "Only for hosts that serve nothing else (a busy normal task starves the workers).",
    )
    worker_host: str = Field(
        default="auto",
        description="Interface workers bind and advertise; 'auto' = 127.0.0.1, or the node IP "
        "when joining an external Ray cluster.",
    )
    ray: RaySection = Field(default_factory=RaySection, description="Ray placement.")
    router: RouterSection = Field(default_factory=RouterSection, description="Public router.")
    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="Every worker's engine (KV cache, batching)."
    )
    transfer: TransferSection = Field(
        default_factory=TransferSection, description="KV transfer between workers."
    )
    ratio: RatioConfig = Field(
        default_factory=RatioConfig,
        description="Prefill:decode ratio controller run by the router (default mode 'fixed': "
        "off). Its bounds must contain workers.prefill / workers.decode.",
    )
    supervision: SupervisionConfig = Field(
        default_factory=SupervisionConfig,
        description="How the process launcher restarts dead workers (backoff, limits); Ray "
        "restarts its actors itself (ray.max_restarts).",
    )
    security: SecurityConfig = Field(
        default_factory=SecurityConfig,
        description="TLS / mutual TLS / bearer tokens on the public API, the cluster secret "
        "file and router<->worker mutual TLS (docs/security.md).",
    )
    tracing: TracingConfig = Field(
        default_factory=TracingConfig,
        description="OpenTelemetry traces of every request, in the router and every worker "
        "(docs/observability.md); default off.",
    )

    @model_validator(mode="before")
    @classmethod
    def _default_counts(cls, data: Any) -> Any:
        """Fill the worker counts the file left out from `mode` (see `WorkerCounts`)."""
        if not isinstance(data, Mapping):
            return data
        mode = data.get("mode", "disagg")
        counts = data.get("workers", {})
        if not isinstance(counts, Mapping):
            return data
        defaults = {"prefill": 1, "decode": 1} if mode == "disagg" else {"colocated": 1}
        if mode in ("disagg", "colocated"):
            return {**data, "workers": {**defaults, **counts}}
        return data

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        w = self.workers
        if self.mode == "disagg":
            if w.prefill < 1 or w.decode < 1:
                raise ValueError(
                    f"mode 'disagg' needs workers.prefill >= 1 and workers.decode >= 1, got "
                    f"workers.prefill={w.prefill}, workers.decode={w.decode}"
                )
            if w.colocated:
                raise ValueError(f"workers.colocated must be 0 in mode 'disagg', got {w.colocated}")
        else:
            if w.colocated < 1:
                raise ValueError(
                    f"mode 'colocated' needs workers.colocated >= 1, got {w.colocated}"
                )
            if w.prefill or w.decode:
                raise ValueError(
                    f"workers.prefill and workers.decode must be 0 in mode 'colocated', got "
                    f"workers.prefill={w.prefill}, workers.decode={w.decode}"
                )
        self._check_ratio()
        if self.router.hybrid.enabled and self.mode != "disagg":
            raise ValueError(
                "router.hybrid.local_prefill_max_tokens > 0 lets decode workers prefill; it "
                f"needs mode 'disagg', got mode={self.mode!r}"
            )
        if self.router.hybrid.adaptive and not self.ratio.enabled:
            raise ValueError(
                "router.hybrid.max_local_prefill_max_tokens > 0 asks the ratio controller to "
                "move the threshold; it needs [ratio] mode 'adaptive' or 'advisory', got "
                "'fixed' (set max_local_prefill_max_tokens = 0 for a fixed threshold)"
            )
        self.security.check_bind(self.router.host, "router.host")
        r = self.ray
        if r.address and r.num_cpus is not None:
            raise ValueError(
                f"ray.num_cpus sizes a local cluster; it must be unset when ray.address is set "
                f"(ray.address={r.address!r}, ray.num_cpus={r.num_cpus})"
            )
        need = self.num_workers * r.cpus_per_worker
        if self.launcher == "ray" and r.num_cpus is not None and need > r.num_cpus:
            raise ValueError(
                f"{self.num_workers} workers x ray.cpus_per_worker={r.cpus_per_worker} need "
                f"{need:g} CPUs but ray.num_cpus={r.num_cpus}: raise ray.num_cpus (or leave it "
                f"unset: pdserve up sizes its local cluster for the workers), lower "
                f"ray.cpus_per_worker, or start fewer workers"
            )
        cuda = self.engine.device.startswith("cuda")
        if r.gpus_per_worker > 0 and not cuda:
            raise ValueError(
                f"ray.gpus_per_worker={r.gpus_per_worker:g} reserves GPUs the workers would not "
                f"use: engine.device is {self.engine.device!r} (set it to 'cuda')"
            )
        if self.launcher == "ray" and cuda and r.gpus_per_worker == 0:
            raise ValueError(
                f"engine.device={self.engine.device!r} under launcher 'ray' needs "
                f"ray.gpus_per_worker >= 1 (Ray hides GPUs from actors that reserve none)"
            )
        return self

    def _check_ratio(self) -> None:
        """`[ratio]` against the topology: disagg only, and the starting counts inside the
        bounds."""
        ratio, w = self.ratio, self.workers
        if not ratio.enabled:
            return
        if self.mode != "disagg":
            raise ValueError(
                f"ratio.mode={ratio.mode!r} tunes prefill:decode workers; it needs mode "
                f"'disagg', got mode={self.mode!r}"
            )
        try:
            ratio.check_counts(w.prefill, w.decode)
        except ValueError as exc:
            raise ValueError(
                f"{exc} (workers.prefill={w.prefill}, workers.decode={w.decode})"
            ) from None

    # ------------------------------------------------------------------ derived values

    @property
    def num_workers(self) -> int:
        """Worker processes in total."""
        return self.workers.prefill + self.workers.decode + self.workers.colocated

    def worker_roles(self) -> list[tuple[str, Role]]:
        """(worker_id, role) of every worker to start, in a stable order:
        prefill-0.., decode-0.., colocated-0.."""
        out: list[tuple[str, Role]] = []
        for role in ROLE_NAMES:
            out += [(f"{role}-{i}", role) for i in range(getattr(self.workers, role))]
        return out

    def router_config(
        self,
        addresses: Mapping[str, list[str]],
        **overrides: Any,
    ) -> RouterConfig:
        """The `RouterConfig` for this cluster once its workers run at `addresses`
        (role -> host:port list): every ``[router]`` setting as it is (whatever fields
        `RouterSettings` has), plus what the cluster decides; `overrides` replace RouterConfig
        fields (tests, extra routers)."""
        settings = {name: getattr(self.router, name) for name in RouterSettings.model_fields}
        fields: dict[str, Any] = {
            **settings,
            "model_dir": self.model,
            "mode": self.mode,
            "prefill_addrs": tuple(addresses.get("prefill", ())),
            "decode_addrs": tuple(addresses.get("decode", ())),
            "colocated_addrs": tuple(addresses.get("colocated", ())),
            "ratio": self.ratio,
            "security": self.security,
            "tracing": self.tracing,
        }
        return RouterConfig(**{**fields, **overrides})

    def worker_config(
        self, worker_id: str, role: Role, host: str, port: int = 0, node: str = ""
    ) -> WorkerConfig:
        """The `WorkerConfig` of one worker of this cluster: the one place cluster keys become
        worker settings (both launchers hand the result to the worker whole, as JSON).
        `host`: the interface it binds and advertises ("auto" = its Ray node's IP, resolved by
        the actor); `port` 0 picks one (a restart passes the old one); `node`: its node label
        ("auto" = Ray's node id)."""
        kv_host = host if self.transfer.kv_host == "auto" else self.transfer.kv_host
        return WorkerConfig(
            worker_id=worker_id,
            model_dir=self.model.resolve(),
            role=role,
            engine=self.engine,
            host=host,
            port=port,
            torch_threads=self.torch_threads,
            nice=self.worker_nice,
            sched_idle=self.worker_sched_idle,
            transfer_timeout_s=self.transfer.timeout_s,
            kv_host=kv_host,
            kv_shared_memory=self.transfer.shared_memory,
            node=node,
            internal_tls=self.security.internal,
            insecure=self.security.insecure,
            stop_grace_s=self.drain_timeout_s,
            tracing=self.tracing,
        )


def check_model_dir(config: ClusterConfig) -> None:
    """Raise ValueError naming `model` unless it is a folder with a config.json (checked at
    launch, not at load, so example configs validate without their model present)."""
    if not (config.model / "config.json").is_file():
        raise ValueError(f"model: {str(config.model)!r} is not a model folder (no config.json)")


UNSET: Any = object()
"""Override value that removes a key from the file's values (so its default applies)."""


def set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    """`data["a"]["b"] = value` for `key` "a.b", creating tables on the way; `UNSET` removes
    the key instead."""
    *tables, last = key.split(".")
    node = data
    for name in tables:
        child = node.setdefault(name, {})
        if not isinstance(child, dict):
            raise ValueError(f"{key}: {name!r} is not a table")
        node = child
    if value is UNSET:
        node.pop(last, None)
    else:
        node[last] = value


def load_cluster_config(
    path: str | Path | None = None, overrides: Mapping[str, Any] | None = None
) -> ClusterConfig:
    """Read TOML `path` (none: start from defaults), apply dotted-key `overrides` whose value
    is not None (`UNSET` removes the key), validate. Raises OSError for an unreadable file,
    ValueError for bad TOML (with the file name) and pydantic.ValidationError for bad values
    (each naming its field path)."""
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"{path}: invalid TOML: {exc}") from exc
    for key, value in (overrides or {}).items():
        if value is not None:
            set_dotted(data, key, value)
    return ClusterConfig.model_validate(data)
