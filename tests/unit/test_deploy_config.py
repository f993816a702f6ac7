"""`deploy.config.ClusterConfig`: TOML loading, CLI overrides, errors that name their fields,
and every shipped deployment file (example TOMLs, Ray cluster YAML, KubeRay manifest).

Pure and fast: no processes, no Ray, no network.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import tomllib
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from deploy import config as deploy_config
from deploy.cli import build_parser, up_overrides
from deploy.client import build_request
from deploy.config import ClusterConfig, check_model_dir, load_cluster_config
from deploy.launcher import router_document, router_env, write_document
from router.config import RouterConfig
from worker.cli import parse_args as parse_worker_args
from worker.config import WorkerConfig, thread_env
from worker.server import lower_priority

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.toml"))


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "cluster.toml"
    path.write_text(text)
    return path


def test_toml_load_and_defaults(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        model = "m"
        torch_threads = 2
        [workers]
        prefill = 2
        [router]
        port = 0
        max_queued = 4
        [engine]
        block_size = 32
        num_kv_blocks = 100
        [worker]
        stop_grace_s = 5
        """,
    )
    c = load_cluster_config(path)
    assert (c.mode, c.launcher, c.torch_threads) == ("disagg", "ray", 2)
    assert (c.workers.prefill, c.workers.decode, c.workers.colocated) == (2, 1, 0)
    assert (c.router.port, c.router.max_queued, c.router.max_inflight) == (0, 4, 64)
    assert (c.engine.block_size, c.engine.num_kv_blocks, c.worker.stop_grace_s) == (32, 100, 5)
    assert c.worker_roles() == [
        ("prefill-0", "prefill"),
        ("prefill-1", "prefill"),
        ("decode-0", "decode"),
    ]
    # The effective config round-trips through its JSON (what `pdserve up` logs).
    assert ClusterConfig.model_validate_json(c.model_dump_json()) == c
    with pytest.raises(ValidationError):
        c.torch_threads = 3  # type: ignore[misc]  # frozen


def test_colocated_counts_default_from_mode() -> None:
    c = load_cluster_config(None, {"model": "m", "mode": "colocated"})
    assert (c.workers.prefill, c.workers.decode, c.workers.colocated) == (0, 0, 1)
    assert c.num_workers == 1


def test_cli_flags_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, 'model = "a"\n[workers]\nprefill = 1\ndecode = 1\n[router]\nport = 7\n')
    args = build_parser().parse_args(
        [
            "up",
            "--config",
            str(path),
            "--model",
            "b",
            "--prefill",
            "3",
            "--port",
            "0",
            "--ray-address",
            "auto",
            "--torch-threads",
            "2",
        ]
    )
    c = load_cluster_config(args.config, up_overrides(args))
    assert (str(c.model), c.workers.prefill, c.workers.decode, c.router.port) == ("b", 3, 1, 0)
    assert (c.ray.address, c.torch_threads, c.launcher) == ("auto", 2, "ray")
    # --ray-address drops the file's local-cluster size instead of failing on it.
    sized = _write(tmp_path, 'model = "a"\n[ray]\nnum_cpus = 2\n')
    args = build_parser().parse_args(["up", "--config", str(sized), "--ray-address", "auto"])
    c = load_cluster_config(args.config, up_overrides(args))
    assert (c.ray.address, c.ray.num_cpus) == ("auto", None)
    # --mode alone zeroes the roles that mode does not use; --no-ray picks the process launcher.
    args = build_parser().parse_args(
        ["up", "--config", str(path), "--mode", "colocated", "--no-ray"]
    )
    c = load_cluster_config(args.config, up_overrides(args))
    assert (c.mode, c.workers.colocated, c.workers.prefill, c.launcher) == (
        "colocated",
        1,
        0,
        "process",
    )


@pytest.mark.parametrize(
    ("data", "names"),
    [
        ({}, ["model"]),
        ({"model": "m", "mode": "both"}, ["mode"]),
        ({"model": "m", "workers": {"prefill": 0}}, ["workers.prefill"]),
        ({"model": "m", "workers": {"decode": -1}}, ["workers.decode"]),
        ({"model": "m", "workers": {"colocated": 1}}, ["workers.colocated", "disagg"]),
        ({"model": "m", "mode": "colocated", "workers": {"colocated": 0}}, ["workers.colocated"]),
        ({"model": "m", "mode": "colocated", "workers": {"prefill": 1}}, ["workers.prefill"]),
        ({"model": "m", "torch_threads": 0}, ["torch_threads"]),
        ({"model": "m", "worker": {"nice": 20}}, ["worker.nice"]),
        ({"model": "m", "worker_nice": 20}, ["worker.nice"]),  # a deprecated alias
        ({"model": "m", "router": {"port": 70000}}, ["router.port"]),
        ({"model": "m", "router": {"policy": "random"}}, ["router.policy"]),
        ({"model": "m", "router": {"max_inflight": 0}}, ["router.max_inflight"]),
        ({"model": "m", "router": {"prot": 1}}, ["router.prot"]),
        ({"model": "m", "engine": {"block_size": 0}}, ["engine.block_size"]),
        ({"model": "m", "engine": {"max_num_seqs": 999}}, ["max_num_seqs"]),
        ({"model": "m", "worker": {"stop_grace_s": -1}}, ["worker.stop_grace_s"]),
        ({"model": "m", "worker_nice": 1, "worker": {"nice": 2}}, ["worker_nice", "worker.nice"]),
        ({"model": "m", "ray": {"address": "a", "num_cpus": 2}}, ["ray.num_cpus", "ray.address"]),
        ({"model": "m", "ray": {"num_cpus": 1}}, ["ray.num_cpus", "ray.cpus_per_worker"]),
        ({"model": "m", "ray": {"gpus_per_worker": 1}}, ["ray.gpus_per_worker", "engine.device"]),
        ({"model": "m", "engine": {"device": "cuda"}}, ["engine.device", "ray.gpus_per_worker"]),
        ({"model": "m", "ray": {"placement_strategy": "RANDOM"}}, ["ray.placement_strategy"]),
        ({"model": "m", "extra": 1}, ["extra"]),
        ({"model": "m", "router": {"prefix_index": {"kind": "redis"}}}, ["router.prefix_index"]),
    ],
)
def test_bad_values_name_their_fields(data: dict[str, object], names: list[str]) -> None:
    with pytest.raises(ValidationError) as info:
        ClusterConfig.model_validate(data)
    message = str(info.value)
    for name in names:
        assert name in message, f"{name!r} not named in:\n{message}"


def test_gpu_config_is_valid_with_gpus_reserved() -> None:
    c = ClusterConfig.model_validate(
        {"model": "m", "engine": {"device": "cuda"}, "ray": {"gpus_per_worker": 1}}
    )
    assert c.ray.gpus_per_worker == 1
    # Without Ray the GPU needs no reservation.
    no_ray = {"model": "m", "launcher": "process", "engine": {"device": "cuda"}}
    ClusterConfig.model_validate(no_ray)


def test_file_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="invalid TOML"):
        load_cluster_config(_write(tmp_path, "model = \n"))
    with pytest.raises(OSError):
        load_cluster_config(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match="model"):
        check_model_dir(ClusterConfig(model=tmp_path))


def test_router_config_and_documents(tmp_path: Path) -> None:
    c = load_cluster_config(None, {"model": "m", "router.port": 0, "router.max_queued": 3})
    rc = c.router_config({"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    assert (rc.mode, rc.prefill_addrs, rc.decode_addrs, rc.max_queued) == (
        "disagg",
        ("127.0.0.1:1",),
        ("127.0.0.1:2",),
        3,
    )
    assert RouterConfig.model_validate_json(router_document(rc)) == rc.model_copy(
        update={"model_dir": Path("m").resolve()}
    )
    redis = {"kind": "redis", "url": "redis://u:hunter2@127.0.0.1:6379/0", "key_prefix": "k:"}
    c2 = load_cluster_config(None, {"model": "m", "router.prefix_index": redis})
    rc2 = c2.router_config({"prefill": ["h:1"], "decode": ["h:2"]})
    doc = router_document(rc2)
    index = json.loads(doc)["prefix_index"]
    assert (index["url"], index["key_prefix"]) == ("redis://u@127.0.0.1:6379/0", "k:")
    assert "hunter2" not in doc  # the password goes through the environment
    assert router_env(rc2, None) == {"PDSERVE_REDIS_PASSWORD": "hunter2"}
    assert "hunter2" not in c2.model_dump_json()  # nor into the effective-config dump
    niced = load_cluster_config(None, {"model": "m", "worker.nice": 7})
    path = write_document(
        tmp_path, "w", niced.worker_config("decode-0", "decode", "h").model_dump_json()
    )
    wc, _ = parse_worker_args(["--config", str(path)])
    assert (wc.nice, wc.role, wc.worker_id, wc.engine) == (7, "decode", "decode-0", c.engine)
    with pytest.raises(SystemExit):  # the document is the whole config: no flag beside it
        parse_worker_args(["--config", str(path), "--nice", "3"])


def test_generate_request_builder() -> None:
    req = build_request(token_ids=[1, 2], max_tokens=4, temperature=0.5, stop=["x"], seed=3)
    assert list(req.token_ids.ids) == [1, 2] and req.sampling.max_tokens == 4
    assert req.sampling.HasField("seed") and not req.sampling.HasField("top_p")
    with pytest.raises(ValueError):
        build_request(prompt="a", token_ids=[1])
    args = build_parser().parse_args(
        ["generate", "--addr", "h:1", "--token-ids", "1,2,3", "--stop", "a", "b"]
    )
    assert (args.token_ids, args.stop) == ([1, 2, 3], ["a", "b"])


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_configs_validate(path: Path) -> None:
    c = load_cluster_config(path)
    assert c.num_workers >= 1


def test_examples_present() -> None:
    assert {p.name for p in EXAMPLES} >= {
        "disagg-1p1d.toml",
        "disagg-2p2d.toml",
        "colocated.toml",
        "hybrid-1p1d.toml",
    }


def _yaml_docs(path: Path) -> list[dict[str, object]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def test_ray_cluster_yaml() -> None:
    (doc,) = _yaml_docs(DEPLOY / "ray-cluster.yaml")
    assert {"cluster_name", "provider", "head_start_ray_commands"} <= set(doc)
    spec = importlib.util.find_spec("ray")
    jsonschema = pytest.importorskip("jsonschema", reason="jsonschema not installed")
    if spec is not None and spec.origin is not None:
        schema = Path(spec.origin).parent / "autoscaler" / "ray-schema.json"
        jsonschema.validate(doc, json.loads(schema.read_text()))  # Ray's own schema


def test_kuberay_manifest() -> None:
    docs = {d["kind"]: d for d in _yaml_docs(DEPLOY / "kuberay.yaml")}
    rc = docs["RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1"
    head = rc["spec"]["headGroupSpec"]["template"]["spec"]  # type: ignore[index]
    commands = json.dumps(head["containers"])
    assert "pdserve up" in commands and "--ray-address auto" in commands
    assert rc["spec"]["workerGroupSpecs"]  # type: ignore[index]
    # The cluster TOML it mounts validates too.
    toml = docs["ConfigMap"]["data"]["cluster.toml"]  # type: ignore[index]
    c = ClusterConfig.model_validate(tomllib.loads(toml))
    assert (c.ray.address, c.router.port) == ("auto", 50051)


def _niceness_after(nice: int, queue: Any, sched_idle: bool = False) -> None:
    queue.put((lower_priority(nice, sched_idle), os.sched_getscheduler(0)))


def test_lower_priority_raises_niceness_and_never_lowers_it() -> None:
    """In a child process: raising niceness cannot be undone without privileges."""
    ctx = multiprocessing.get_context("spawn")
    for nice, want in ((5, 5), (0, 0)):
        queue = ctx.Queue()
        proc = ctx.Process(target=_niceness_after, args=(nice, queue))
        proc.start()
        got, policy = queue.get(timeout=60)
        proc.join(30)
        assert got == max(want, os.getpriority(os.PRIO_PROCESS, 0)), (nice, got)
        assert policy == os.sched_getscheduler(0), policy  # unchanged without sched_idle


def test_lower_priority_sched_idle_moves_the_process_to_sched_idle() -> None:
    """In a child process (SCHED_IDLE cannot be left without privileges)."""
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_niceness_after, args=(3, queue, True))
    proc.start()
    got, policy = queue.get(timeout=60)
    proc.join(30)
    assert got == max(3, os.getpriority(os.PRIO_PROCESS, 0))
    assert policy == os.SCHED_IDLE


def test_worker_sched_idle_reaches_the_worker(tmp_path: Path) -> None:
    """Both launchers hand a worker `ClusterConfig.worker_config` whole (the process launcher
    as its --config file, the Ray launcher as its actor's argument)."""
    on = load_cluster_config(None, {"model": "m", "worker.sched_idle": True})
    off = load_cluster_config(None, {"model": "m"})
    for config, want in ((on, True), (off, False)):
        doc = config.worker_config("w0", "prefill", "127.0.0.1").model_dump_json()
        wc, _ = parse_worker_args(["--config", str(write_document(tmp_path, "w0", doc))])
        assert wc.sched_idle is want


def test_ray_bundles_deal_the_roles_in_turn() -> None:
    """SPREAD then gives each node a prefill and a decode worker, however it deals bundles."""
    from deploy.ray_launcher import interleave_roles
    from proto.pdserve.v1.roles import Role

    p: Role = "prefill"
    d: Role = "decode"
    roles = [("prefill-0", p), ("prefill-1", p), ("decode-0", d), ("decode-1", d)]
    got = [wid for wid, _ in interleave_roles(roles)]
    assert got == ["prefill-0", "decode-0", "prefill-1", "decode-1"]


def test_ray_bundles_by_node_give_every_node_both_roles() -> None:
    """However Ray dealt the bundles (in turn, or in halves), worker k of the interleaved roles
    goes to a bundle such that each node holds a prefill and a decode worker."""
    from deploy.ray_launcher import bundles_by_node

    roles = ["prefill", "decode", "prefill", "decode"]  # interleave_roles' order
    for dealt in (["A", "B", "A", "B"], ["A", "A", "B", "B"], ["B", "A", "A", "B"]):
        order = bundles_by_node(dealt)
        assert sorted(order) == [0, 1, 2, 3]
        per_node: dict[str, set[str]] = {}
        for k, bundle in enumerate(order):
            per_node.setdefault(dealt[bundle], set()).add(roles[k])
        assert all(r == {"prefill", "decode"} for r in per_node.values()), (dealt, per_node)
    assert bundles_by_node(["", "", ""]) == [0, 1, 2]  # one node (or unknown): as placed


def test_router_hybrid_section_reaches_the_router_config() -> None:
    """`[router.hybrid]` -> RouterConfig.hybrid (issue 31; the router process gets it with the
    whole document, `test_config_documents`); off by default, refused outside mode 'disagg'."""
    c = load_cluster_config(DEPLOY / "examples" / "hybrid-1p1d.toml")
    assert c.router.hybrid.local_prefill_max_tokens == 128
    rc = c.router_config({"prefill": ["127.0.0.1:1"], "decode": ["127.0.0.1:2"]})
    assert rc.hybrid == c.router.hybrid and rc.hybrid.enabled
    plain = load_cluster_config(None, {"model": "m"})
    off = plain.router_config({"prefill": ["h:1"], "decode": ["h:2"]})
    assert not off.hybrid.enabled
    with pytest.raises(ValueError, match="needs mode 'disagg'"):
        load_cluster_config(
            None,
            {"model": "m", "mode": "colocated", "router.hybrid.local_prefill_max_tokens": 8},
        )


def test_router_hybrid_threshold_bounds_reach_the_router_and_need_a_controller() -> None:
    """`[router.hybrid] max_local_prefill_max_tokens` (online threshold control, issue 31)
    reaches RouterConfig with the section; without a `[ratio]` controller it is refused at
    load time, naming both keys."""
    keys = {
        "model": "m",
        "router.hybrid.local_prefill_max_tokens": 64,
        "router.hybrid.max_local_prefill_max_tokens": 256,
    }
    with pytest.raises(ValueError, match=r"max_local_prefill_max_tokens > 0 .* \[ratio\] mode"):
        load_cluster_config(None, keys)
    ratio = {"ratio.mode": "advisory", "ratio.slo_ttft_ms": 500, "ratio.slo_tpot_ms": 50}
    c = load_cluster_config(None, {**keys, **ratio})
    rc = c.router_config({"prefill": ["h:1"], "decode": ["h:2"]})
    assert rc.hybrid.adaptive and rc.hybrid.max_local_prefill_max_tokens == 256


def test_renamed_keys_keep_their_old_names_with_a_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Old cluster keys still load, moved to the keys they were renamed to (the workers'
    settings under their own names, `[worker]`), each warned about once per process;
    `transfer.timeout_s`, which never applied to a routed request, is dropped with a warning."""
    monkeypatch.setattr(deploy_config, "_warned", set())
    old = {
        "model": "m",
        "worker_nice": 4,
        "worker_sched_idle": True,
        "drain_timeout_s": 9.0,
        "transfer": {"shared_memory": False, "timeout_s": 12.0, "kv_host": "10.0.0.1"},
    }
    with caplog.at_level(logging.WARNING, logger="deploy.config"):
        c = load_cluster_config(None, old)
        load_cluster_config(None, old)  # once per process
    w = c.worker
    assert (w.nice, w.sched_idle, w.stop_grace_s, w.kv_shared_memory) == (4, True, 9.0, False)
    assert c.transfer.kv_host == "10.0.0.1"
    new = {
        "model": "m",
        "worker": {"nice": 4, "sched_idle": True, "stop_grace_s": 9.0, "kv_shared_memory": False},
        "transfer": {"kv_host": "10.0.0.1"},
    }
    assert load_cluster_config(None, new) == c
    warned = [r.getMessage() for r in caplog.records]
    for key in ("worker_nice", "worker_sched_idle", "drain_timeout_s", "transfer.shared_memory"):
        assert sum(key in m and "deprecated" in m for m in warned) == 1, (key, warned)
    assert sum("transfer.timeout_s" in m and "ignored" in m for m in warned) == 1, warned


def test_threads_reach_a_worker_one_way(tmp_path: Path) -> None:
    """A worker's `torch_threads` is where its threads come from: the worker applies it and
    both launchers derive its OpenMP and MKL pools from it (`thread_env`)."""
    c = load_cluster_config(None, {"model": "m", "torch_threads": 3})
    wc = c.worker_config("w0", "decode", "127.0.0.1")
    assert wc.torch_threads == 3
    assert thread_env(wc) == {"OMP_NUM_THREADS": "3", "MKL_NUM_THREADS": "3"}
    assert thread_env(WorkerConfig(model_dir=tmp_path, role="decode")) == {}


def test_speculative_table_reaches_workers_with_the_draft_path_resolved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`[engine.speculative]` is every worker's; a relative draft path is relative to where
    the cluster is launched (as `model` is), and a missing draft fails the launch check."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    cfg = load_cluster_config(
        None,
        {
            "model": "m",
            "engine.speculative": {"method": "draft", "model": "d", "num_speculative_tokens": 3},
        },
    )
    spec = cfg.worker_config("decode-0", "decode", "127.0.0.1").engine.speculative
    assert spec is not None and spec.method == "draft"
    assert spec.model == tmp_path / "d" and spec.num_speculative_tokens == 3
    with pytest.raises(ValueError, match=r"engine\.speculative\.model"):
        check_model_dir(cfg)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text("{}")
    check_model_dir(cfg)
    ngram = load_cluster_config(None, {"model": "m", "engine.speculative.method": "ngram"})
    assert ngram.worker_config("c", "colocated", "127.0.0.1").engine.speculative == (
        ngram.engine.speculative
    )
    with pytest.raises(ValidationError, match="prompt_lookup_min"):
        load_cluster_config(
            None,
            {"engine.speculative": {"method": "ngram", "prompt_lookup_min": 5}},
        )
