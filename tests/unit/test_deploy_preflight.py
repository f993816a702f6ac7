"""`deploy.preflight`: local Ray clusters sized for the workers, placement that can never happen
named at once, and Redis URLs that would reach Ray's GCS instead — including every shipped
example config against the Ray port of the file that launches it. Pure: no Ray, no network."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from deploy.config import ClusterConfig, load_cluster_config
from deploy.preflight import local_cluster_cpus, placement_problem, redis_ray_collision

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
EXAMPLES = sorted((DEPLOY / "examples").glob("*.toml"))


def test_local_cluster_is_sized_for_the_workers_and_says_so() -> None:
    cpus, note = local_cluster_cpus(3, 1.0, None, machine_cpus=2)  # up --prefill 2 --decode 1
    assert cpus == 3
    assert note is not None and "3 CPUs for 3 workers" in note and "has 2" in note
    assert "\n" not in note
    assert local_cluster_cpus(2, 1.0, None, machine_cpus=4) == (4, None)
    assert local_cluster_cpus(2, 1.0, 2, machine_cpus=16) == (2, None)  # ray.num_cpus kept
    assert local_cluster_cpus(3, 1.5, None, machine_cpus=2)[0] == 5  # ceil(4.5)


def test_placement_problem_names_the_shortage_and_the_fix() -> None:
    two_cpu = [{"CPU": 2.0, "memory": 1e9}]
    msg = placement_problem({"CPU": 1.0}, 3, two_cpu)
    assert msg is not None and "2 CPU in all (need 3)" in msg and "ray.cpus_per_worker" in msg
    assert placement_problem({"CPU": 1.0}, 2, two_cpu) is None
    big = placement_problem({"CPU": 4.0}, 2, [{"CPU": 2.0}] * 4)  # 8 in all, no node fits one
    assert big is not None and "largest node has 2 CPU" in big
    gpu = placement_problem({"CPU": 1.0, "GPU": 1.0}, 2, [{"CPU": 8.0}])
    assert gpu is not None and "0 GPU in all" in gpu and "ray.gpus_per_worker" in gpu
    assert placement_problem({"CPU": 1.0, "GPU": 1.0}, 2, [{"CPU": 8.0, "GPU": 2.0}]) is None


@pytest.mark.parametrize(
    ("url", "gcs", "here", "collides"),
    [
        ("redis://127.0.0.1:6379/0", "10.0.0.10:6379", "10.0.0.10", True),  # router on the head
        ("redis://localhost/0", "127.0.0.1:6379", "127.0.0.1", True),  # Redis's default port
        ("redis://10.0.0.10:6379/0", "10.0.0.10:6379", "10.0.0.11", True),
        ("redis://127.0.0.1:6379/0", "10.0.0.10:6379", "10.0.0.11", False),  # another node
        ("redis://127.0.0.1:6380/0", "10.0.0.10:6379", "10.0.0.10", False),
        ("redis://10.0.0.12:6379/0", "10.0.0.10:6379", "10.0.0.10", False),
        ("unix:///run/redis.sock", "127.0.0.1:6379", "127.0.0.1", False),
    ],
)
def test_redis_ray_collision(url: str, gcs: str, here: str, collides: bool) -> None:
    msg = redis_ray_collision(url, gcs, here)
    assert (msg is not None) == collides, msg
    if msg:
        assert "router.prefix_index.url" in msg and "another port" in msg


# ---- every shipped example against the Ray port it is launched with --------------------------


def _yaml_docs(path: Path) -> list[dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed")
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def _ray_cluster_port() -> int:
    """The GCS port `ray start --head` gets in deploy/ray-cluster.yaml (Ray's default: 6379)."""
    (doc,) = _yaml_docs(DEPLOY / "ray-cluster.yaml")
    (head,) = [c for c in doc["head_start_ray_commands"] if "ray start --head" in c]
    m = re.search(r"--port[= ](\d+)", head)
    return int(m.group(1)) if m else 6379


def _kuberay() -> tuple[int, ClusterConfig]:
    """The KubeRay head's GCS port and the cluster TOML its pdserve container runs."""
    docs = {d["kind"]: d for d in _yaml_docs(DEPLOY / "kuberay.yaml")}
    params = docs["RayCluster"]["spec"]["headGroupSpec"].get("rayStartParams", {})
    config = ClusterConfig.model_validate(tomllib.loads(docs["ConfigMap"]["data"]["cluster.toml"]))
    return int(params.get("port", 6379)), config


def _launched() -> list[tuple[str, ClusterConfig, int]]:
    """(what, config, Ray GCS port) for every config a Ray launch file runs: the examples that
    name the launch file or that it names, and KubeRay's own TOML."""
    out: list[tuple[str, ClusterConfig, int]] = []
    launchers = {"ray-cluster.yaml": _ray_cluster_port(), "kuberay.yaml": _kuberay()[0]}
    for name, port in launchers.items():
        text = (DEPLOY / name).read_text()
        for example in EXAMPLES:
            if example.name in text or name in example.read_text():
                out.append((f"{example.name} on {name}", load_cluster_config(example), port))
    port, config = _kuberay()
    out.append(("kuberay.yaml's cluster.toml", config, port))
    return out


def test_no_example_redis_url_is_the_ray_port_it_is_launched_with() -> None:
    launched = _launched()
    with_redis = [(w, c, p) for w, c, p in launched if c.router.prefix_index.kind == "redis"]
    assert with_redis, f"no launched example uses Redis, nothing checked: {launched}"
    for what, config, port in with_redis:
        url = config.router.prefix_index.url  # type: ignore[union-attr]
        # The router (`pdserve up`) runs on Ray's head node in these files.
        assert redis_ray_collision(url, f"127.0.0.1:{port}") is None, what
