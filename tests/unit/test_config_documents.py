"""Every cluster-config field reaches its process: the router and a worker built from the one
JSON document each is handed (`ClusterConfig.router_config` / `worker_config`, written by
`deploy.launcher.write_document`, read back by the entry points' ``--config``) hold exactly
what the cluster config says.

The tests iterate the models' fields, so a field added to `RouterConfig` or `WorkerConfig`
fails here until it is placed: a router setting goes into `RouterSettings` (then it is a
``[router]`` key and flows through with no other code), a worker setting gets its line in
`ClusterConfig.worker_config` and in `WORKER_FROM_CLUSTER` below.

Pure and fast: no processes, no network.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from deploy.config import ClusterConfig, RouterSection
from deploy.launcher import router_document, write_document
from router.__main__ import parse_args as router_args
from router.config import RouterConfig, RouterSettings
from worker.cli import parse_args as worker_args
from worker.config import WorkerConfig

# A value unlike the default for every [router] setting (the router's own fields).
ROUTER_SETTINGS: dict[str, Any] = {
    "model_name": "served-name",
    "policy": "least_load",
    "prefix_index": {"kind": "redis", "url": "redis://127.0.0.1:6390/2", "key_prefix": "t:"},
    "prefix_routing": {"cache_weight": 2.5, "max_pending_blocks": 77},
    "pair_scoring": {"cross_node_gbps": 3.5, "num_layers": 9},
    "host": "127.0.0.2",
    "port": 4321,
    "http_port": 8123,
    "http_header_timeout_s": 16.0,
    "http_default_max_tokens": 321,
    "http_body_timeout_s": 61.0,
    "max_inflight": 5,
    "max_queued": 6,
    "default_timeout_s": 121.0,
    "status_poll_interval_s": 0.7,
    "status_poll_timeout_s": 0.8,
    "status_poll_misses": 4,
    "abort_timeout_s": 2.5,
    "shutdown_grace_s": 31.0,
    "max_route_attempts": 3,
    "max_migrations": 2,
    "stall_timeout_s": 3.5,
    "hybrid": {"local_prefill_max_tokens": 96, "prefill_queue_max_tokens": 500},
}

# What a worker's config takes from the cluster config: field -> (cluster config -> value).
WORKER_FROM_CLUSTER: dict[str, Any] = {
    "model_dir": lambda c: c.model.resolve(),
    "engine": lambda c: c.engine,
    "torch_threads": lambda c: c.torch_threads,
    "nice": lambda c: c.worker_nice,
    "sched_idle": lambda c: c.worker_sched_idle,
    "transfer_timeout_s": lambda c: c.transfer.timeout_s,
    "kv_host": lambda c: c.transfer.kv_host,
    "kv_shared_memory": lambda c: c.transfer.shared_memory,
    "internal_tls": lambda c: c.security.internal,
    "insecure": lambda c: c.security.insecure,
    "stop_grace_s": lambda c: c.drain_timeout_s,
    "tracing": lambda c: c.tracing,
}
# Given by the launcher per worker (arguments of `worker_config`).
WORKER_FROM_LAUNCHER = {"worker_id", "role", "host", "port", "node"}
# Not cluster keys: every launched worker keeps the WorkerConfig default.
WORKER_DEFAULTS = {"metrics_port", "kv_port", "kv_connect_timeout_s", "default_timeout_s"}


def _cluster(tmp_path: Path) -> ClusterConfig:
    pem = tmp_path / "x.pem"
    return ClusterConfig.model_validate(
        {
            "model": str(tmp_path / "model"),
            "launcher": "process",
            "torch_threads": 3,
            "drain_timeout_s": 7.0,
            "worker_nice": 5,
            "worker_sched_idle": True,
            "workers": {"prefill": 2, "decode": 1},
            "router": ROUTER_SETTINGS,
            "engine": {"block_size": 32, "num_kv_blocks": 99},
            "transfer": {"timeout_s": 9.0, "kv_host": "127.0.0.3", "shared_memory": False},
            "ratio": {"mode": "advisory", "slo_ttft_ms": 500, "slo_tpot_ms": 50},
            "tracing": {
                "enabled": True,
                "endpoint": "http://127.0.0.9:4317",
                "sampler": "parentbased_traceidratio",
                "sampler_arg": 0.25,
                "capture_content": True,
            },
            "security": {
                "insecure": True,
                "internal": {"tls_cert": str(pem), "tls_key": str(pem), "tls_ca": str(pem)},
            },
        }
    )


def test_every_router_setting_is_a_cluster_key_and_differs_from_its_default() -> None:
    """`ROUTER_SETTINGS` covers every field, so the equality below is not vacuous."""
    assert set(ROUTER_SETTINGS) == set(RouterSettings.model_fields)
    assert set(RouterSection.model_fields) == set(RouterSettings.model_fields)
    section = RouterSection.model_validate(ROUTER_SETTINGS)
    for name in RouterSettings.model_fields:
        assert getattr(section, name) != getattr(RouterSection(), name), name


def test_the_router_process_gets_every_field_the_cluster_config_says(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cluster = _cluster(tmp_path)
    addresses = {"prefill": ["127.0.0.1:1", "127.0.0.1:2"], "decode": ["127.0.0.1:3"]}
    doc = write_document(tmp_path, "router-0", router_document(cluster.router_config(addresses)))
    got = router_args(["--config", str(doc)])
    for name in RouterSettings.model_fields:  # every [router] key, whatever fields it has
        assert getattr(got, name) == getattr(cluster.router, name), name
    decided_by_the_cluster = {
        "model_dir": cluster.model.resolve(),
        "mode": cluster.mode,
        "ratio": cluster.ratio,
        "security": cluster.security,
        "tracing": cluster.tracing,
        "prefill_addrs": tuple(addresses["prefill"]),
        "decode_addrs": tuple(addresses["decode"]),
        "colocated_addrs": (),
    }
    assert set(RouterConfig.model_fields) == (
        set(RouterSettings.model_fields) | set(decided_by_the_cluster)
    ), "a RouterConfig field is neither a router setting nor set from the cluster config"
    for name, want in decided_by_the_cluster.items():
        assert getattr(got, name) == want, name


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_process_gets_every_field_the_cluster_config_says(
    tmp_path: Path, role: str
) -> None:
    cluster = _cluster(tmp_path)
    placed = WORKER_FROM_LAUNCHER | WORKER_DEFAULTS | set(WORKER_FROM_CLUSTER)
    assert placed == set(WorkerConfig.model_fields), (
        f"WorkerConfig fields not placed: {set(WorkerConfig.model_fields) - placed}"
    )
    wc = cluster.worker_config(f"{role}-1", role, "127.0.0.1", port=4711)  # type: ignore[arg-type]
    doc = write_document(tmp_path, f"worker-{role}-1", wc.model_dump_json())
    got, _ = worker_args(["--config", str(doc)])
    default = WorkerConfig(model_dir=Path("m"), role="prefill")
    for name, value_of in WORKER_FROM_CLUSTER.items():
        want = value_of(cluster)
        assert getattr(got, name) == want, name
        assert want != getattr(default, name), f"{name}: the test config leaves it at default"
    assert (got.worker_id, got.role, got.host, got.port) == (f"{role}-1", role, "127.0.0.1", 4711)
    for name in WORKER_DEFAULTS:
        assert getattr(got, name) == getattr(default, name), name


def test_the_entry_points_take_the_document_alone(tmp_path: Path) -> None:
    """A launched process gets no config flag: with --config, any other is refused."""
    cluster = _cluster(tmp_path)
    wdoc = write_document(
        tmp_path, "w", cluster.worker_config("p", "prefill", "127.0.0.1").model_dump_json()
    )
    with pytest.raises(SystemExit):
        worker_args(["--config", str(wdoc), "--port", "1"])
    rc = cluster.router_config({"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    rdoc = write_document(tmp_path, "r", router_document(rc))
    with pytest.raises(SystemExit):
        router_args(["--config", str(rdoc), "--max-queued", "1"])
    assert router_args(["--config", str(rdoc), "--log-level", "WARNING"]).max_queued == 6
