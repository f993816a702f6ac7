"""Every cluster-config field reaches its process: the router and a worker built from the one
JSON document each is handed (`ClusterConfig.router_config` / `worker_config`, written by
`deploy.launcher.write_document`, read back by the entry points' ``--config``) hold exactly
what the cluster config says.

The tests iterate the models' fields, so a field added to `RouterConfig` or `WorkerConfig`
fails here until it is placed: a router setting goes into `RouterSettings` (then it is a
``[router]`` key and flows through with no other code), a setting every worker shares into
`WorkerSettings` (a ``[worker]`` key, the same), anything else gets its line in
`ClusterConfig.worker_config` and in `WORKER_FROM_CLUSTER` below. The hand-run command lines
take one flag per field of the same models (`cliflags.model_flags`), checked here too.

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
from worker.config import WorkerConfig, WorkerSettings

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

# A value unlike the default for every [worker] setting (what every worker shares).
WORKER_SETTINGS: dict[str, Any] = {
    "nice": 5,
    "sched_idle": True,
    "kv_shared_memory": False,
    "kv_connect_timeout_s": 11.0,
    "default_timeout_s": 301.0,
    "stop_grace_s": 7.0,
}

# What a worker's config takes from the rest of the cluster config: field -> (cluster config
# -> value); each a decision of the cluster's (a path resolved, an address, the security
# settings router and workers share) or a table of the same name.
WORKER_FROM_CLUSTER: dict[str, Any] = {
    "model_dir": lambda c: c.model.resolve(),
    "engine": lambda c: c.engine,
    "torch_threads": lambda c: c.torch_threads,
    "kv_host": lambda c: c.transfer.kv_host,
    "internal_tls": lambda c: c.security.internal,
    "insecure": lambda c: c.security.insecure,
    "tracing": lambda c: c.tracing,
}
# Given by the launcher per worker (arguments of `worker_config`).
WORKER_FROM_LAUNCHER = {"worker_id", "role", "host", "port", "node"}
# Not cluster keys: every launched worker keeps the WorkerConfig default (a routed Reserve
# always carries its own timeout, so `transfer_timeout_s` serves hand-run workers only).
WORKER_DEFAULTS = {"metrics_port", "kv_port", "transfer_timeout_s"}


def _cluster(tmp_path: Path) -> ClusterConfig:
    pem = tmp_path / "x.pem"
    return ClusterConfig.model_validate(
        {
            "model": str(tmp_path / "model"),
            "launcher": "process",
            "torch_threads": 3,
            "worker": WORKER_SETTINGS,
            "workers": {"prefill": 2, "decode": 1},
            "router": ROUTER_SETTINGS,
            "engine": {"block_size": 32, "num_kv_blocks": 99},
            "transfer": {"kv_host": "127.0.0.3"},
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
    assert set(WORKER_SETTINGS) == set(WorkerSettings.model_fields)
    placed = (
        WORKER_FROM_LAUNCHER
        | WORKER_DEFAULTS
        | set(WORKER_FROM_CLUSTER)
        | set(WorkerSettings.model_fields)
    )
    assert placed == set(WorkerConfig.model_fields), (
        f"WorkerConfig fields not placed: {set(WorkerConfig.model_fields) - placed}"
    )
    wc = cluster.worker_config(f"{role}-1", role, "127.0.0.1", port=4711)  # type: ignore[arg-type]
    doc = write_document(tmp_path, f"worker-{role}-1", wc.model_dump_json())
    got, _ = worker_args(["--config", str(doc)])
    default = WorkerConfig(model_dir=Path("m"), role="prefill")
    for name, value in WORKER_SETTINGS.items():  # every [worker] key, under its own name
        assert getattr(got, name) == value != getattr(default, name), name
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


def _flag_value(value: Any) -> str:
    """A field's value as its flag takes it: JSON for a nested model, else its text."""
    if hasattr(value, "model_dump_json"):
        return str(value.model_dump_json())
    return str(value)


def test_every_worker_field_is_a_flag_of_the_hand_run_worker(tmp_path: Path) -> None:
    """`python -m worker_main` takes one flag per `WorkerConfig` field (derived from the model,
    no second default): the flags of a launched worker's config give that config back."""
    cluster = _cluster(tmp_path)
    want = cluster.worker_config("w-1", "decode", "127.0.0.1", port=4711, node="n")
    argv: list[str] = []
    for name in WorkerConfig.model_fields:
        value = getattr(want, name)
        flag = "--model" if name == "model_dir" else "--" + name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is None:
            argv += [flag, "none"]
        else:
            argv += [
                flag + ("-json" if hasattr(value, "model_dump_json") else ""),
                _flag_value(value),
            ]
    got, _ = worker_args(argv)
    assert got == want


def test_a_worker_flag_left_out_keeps_the_model_default(tmp_path: Path) -> None:
    got, _ = worker_args(["--model", str(tmp_path), "--role", "prefill", "--worker-id", "w"])
    assert got == WorkerConfig(model_dir=tmp_path, role="prefill", worker_id="w")


def test_set_reaches_nested_keys_with_or_without_a_document(tmp_path: Path) -> None:
    sets = ["--set", "engine.block_size=8", "--set", "worker_id=w2", "--set", "node=n1"]
    got, _ = worker_args(["--model", str(tmp_path), "--role", "decode", *sets])
    assert (got.engine.block_size, got.worker_id, got.node) == (8, "w2", "n1")
    cluster = _cluster(tmp_path)
    doc = write_document(
        tmp_path, "w", cluster.worker_config("p", "prefill", "127.0.0.1").model_dump_json()
    )
    got, _ = worker_args(["--config", str(doc), "--set", "engine.num_kv_blocks=7"])
    assert got.engine.num_kv_blocks == 7 and got.engine.block_size == cluster.engine.block_size
    rc = cluster.router_config({"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    rdoc = write_document(tmp_path, "r", router_document(rc))
    routed = router_args(["--config", str(rdoc), "--set", "hybrid.local_prefill_max_tokens=9"])
    assert routed.hybrid.local_prefill_max_tokens == 9 and routed.max_queued == 6


def test_every_router_setting_is_a_flag_of_the_hand_run_router(tmp_path: Path) -> None:
    """`python -m router` takes one flag per `RouterSettings` field (derived from the model):
    the flags of a cluster's router settings give those settings back."""
    section = RouterSettings.model_validate(ROUTER_SETTINGS)
    argv = ["--model", str(tmp_path), "--prefill-addr", "127.0.0.1:1,127.0.0.1:2"]
    argv += ["--decode-addr", "127.0.0.1:3"]
    for name in RouterSettings.model_fields:
        value = getattr(section, name)
        nested = hasattr(value, "model_dump_json")
        flag = "--" + name.replace("_", "-") + ("-json" if nested else "")
        argv += [flag, _flag_value(value)]
    got = router_args(argv)
    for name in RouterSettings.model_fields:
        assert getattr(got, name) == getattr(section, name), name
    assert got.prefill_addrs == ("127.0.0.1:1", "127.0.0.1:2")
    assert got.decode_addrs == ("127.0.0.1:3",)
