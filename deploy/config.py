"""Cluster configuration for `pdserve up` (`ClusterConfig`), loaded from TOML.

Runs in the CLI process (`pdserve up`) and in test fixtures. One frozen pydantic v2 model with a
sub-model per TOML table; every field is described and defaulted where a default makes sense::

    model = "models/small"        # HF model folder, relative to the current directory
    mode = "disagg"               # or "colocated"
    launcher = "ray"              # or "process" (plain subprocesses, `--no-ray`)
    torch_threads = 1             # torch intra-op threads per worker process

    [workers]                     # counts; unset ones default from `mode`
    prefill = 1
    decode = 1

    [worker]   nice = 0  sched_idle = false  stop_grace_s = 30  kv_shared_memory = true ...
               (a `worker.config` WorkerSettings: what every worker shares, under its own names)
    [ray]      address = ""  num_cpus = 4  cpus_per_worker = 1  gpus_per_worker = 0
    [router]   host = "127.0.0.1"  port = 50051  http_port = 8000  policy = "prefix_aware" ...
    [router.prefix_index]  kind = "redis"  url = "redis://127.0.0.1:6380/0"   (default: memory)
    [router.hybrid]  local_prefill_max_tokens = 256  prefill_queue_max_tokens = 0 ...
               (a `router.hybrid` HybridConfig: decode workers prefill short prompts; default off)
    [engine]   block_size = 16  num_kv_blocks = 1024 ...        (a `model_runtime` EngineConfig)
    [transfer] kv_host = "auto"
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
names the offending field by its dotted TOML path.

Keys keep their names on the way to a process: ``[router]`` is the router's `RouterSettings`,
``[worker]`` the workers' `WorkerSettings`, ``[engine]`` / ``[tracing]`` their `engine` /
`tracing`; what `worker_config` derives per worker (its id, role, host, node, model folder,
security) is decided here, not renamed. Keys that were renamed keep their old names as
deprecated aliases, each warned about once per process (`DEPRECATED_KEYS`): `worker_nice`,
`worker_sched_idle`, `drain_timeout_s`, `transfer.shared_memory`; `transfer.timeout_s` is
ignored with a warning (a routed request's Reserve always carries the router's remaining
deadline, so it never applied to one). Nothing discovered at start-up (ports, worker
addresses, KV block counts) is written back into a config: the launchers return it separately.

Importing this module imports torch (through `EngineConfig`); the CLI imports it only inside
the subcommands that need it.
"""

from __future__ import annotations

import logging
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cliflags.model_flags import set_dotted
from deploy.supervision import SupervisionConfig
from model_runtime.engine_config import EngineConfig
from model_runtime.speculative.config import DraftConfig
from proto.pdserve.v1.roles import ROLE_NAMES, Role
from router.config import RouterConfig, RouterSettings
from router.ratio.config import RatioConfig
from security.config import SecurityConfig
from tracing.config import TracingConfig
from worker.config import WorkerConfig, WorkerSettings

log = logging.getLogger(__name__)

Mode = Literal["disagg", "colocated"]

DEPRECATED_KEYS = {
    "worker_nice": "worker.nice",
    "worker_sched_idle": "worker.sched_idle",
    "drain_timeout_s": "worker.stop_grace_s",
    "transfer.shared_memory": "worker.kv_shared_memory",
}
"""Old cluster keys (dotted) -> the keys they were renamed to; still accepted, with a warning."""

IGNORED_KEYS = {
    "transfer.timeout_s": "it never applied to a routed request, whose Reserve always carries "
    "the router's remaining deadline (a worker run by hand takes --transfer-timeout-s)",
}
"""Old cluster keys that no longer do anything: accepted and dropped, with a warning."""
_warned: set[str] = set()


def _get_dotted(data: Mapping[str, Any], key: str) -> tuple[bool, Any]:
    node: Any = data
    for name in key.split("."):
        if not isinstance(node, Mapping) or name not in node:
            return False, None
        node = node[name]
    return True, node


def _drop_dotted(data: dict[str, Any], key: str) -> None:
    *tables, last = key.split(".")
    node = data
    for name in tables:
        child = dict(node[name])  # a copy: the caller's tables stay as they were
        node[name] = child
        node = child
    del node[last]


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        log.warning("%s", message)


def upgrade_keys(data: Mapping[str, Any]) -> dict[str, Any]:
    """`data` (a cluster config's raw values) with every deprecated key moved to its new name
    and every ignored one dropped, each warned about once per process; ValueError naming both
    when a key is given under its old and its new name."""
    out = dict(data)
    for old, new in DEPRECATED_KEYS.items():
        found, value = _get_dotted(out, old)
        if not found:
            continue
        if _get_dotted(out, new)[0]:
            raise ValueError(f"{old} is the old name of {new}; give only {new}")
        _drop_dotted(out, old)
        set_dotted(out, new, value)
        _warn_once(old, f"cluster key {old} is deprecated: it is {new} now")
    for old, why in IGNORED_KEYS.items():
        if _get_dotted(out, old)[0]:
            _drop_dotted(out, old)
            _warn_once(old, f"cluster key {old} is deprecated and ignored: {why}")
    return out


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
    """KV hand-off between prefill and decode workers (what the cluster decides per worker;
    the workers' own transfer settings are ``[worker]``'s, e.g. `kv_shared_memory`)."""

    kv_host: str = Field(
        default="auto",
        description="Address decode workers advertise for KV rendezvous; 'auto' = the worker "
        "host (127.0.0.1 locally, the node IP on an external Ray cluster).",
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
    torch_threads: int = Field(
        default=1,
        ge=1,
        description="torch threads per worker process (its `torch_threads`; the launchers size "
        "its OpenMP and MKL pools to match, `worker.config.thread_env`).",
    )
    worker: WorkerSettings = Field(
        default_factory=WorkerSettings,
        description="What every worker shares (`worker.config.WorkerSettings`, under its own "
        "names): niceness, SCHED_IDLE, its stop grace (a SIGTERM drain: NOT_SERVING, its "
        "requests run this long, the rest are moved), the same-host KV plane, ...",
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
        """Move deprecated keys to their names (`upgrade_keys`); fill the worker counts the
        file left out from `mode` (see `WorkerCounts`)."""
        if not isinstance(data, Mapping):
            return data
        data = upgrade_keys(data)
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
        shared = {name: getattr(self.worker, name) for name in WorkerSettings.model_fields}
        engine = self.engine
        if isinstance(engine.speculative, DraftConfig):  # relative to here, as `model` is
            draft = engine.speculative.model_copy(
                update={"model": engine.speculative.model.resolve()}
            )
            engine = engine.model_copy(update={"speculative": draft})
        return WorkerConfig(
            **shared,
            worker_id=worker_id,
            model_dir=self.model.resolve(),
            role=role,
            engine=engine,
            host=host,
            port=port,
            torch_threads=self.torch_threads,
            kv_host=kv_host,
            node=node,
            internal_tls=self.security.internal,
            insecure=self.security.insecure,
            tracing=self.tracing,
        )


def check_model_dir(config: ClusterConfig) -> None:
    """Raise ValueError naming `model` unless it is a folder with a config.json (checked at
    launch, not at load, so example configs validate without their model present)."""
    if not (config.model / "config.json").is_file():
        raise ValueError(f"model: {str(config.model)!r} is not a model folder (no config.json)")
    spec = config.engine.speculative
    if isinstance(spec, DraftConfig) and not (spec.model / "config.json").is_file():
        raise ValueError(
            f"engine.speculative.model: {str(spec.model)!r} is not a model folder (no config.json)"
        )


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
