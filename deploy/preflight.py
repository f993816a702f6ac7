"""Checks `pdserve up` makes before it waits on anything: can Ray place the workers, and does
the Redis URL point at a Redis (not at Ray's own GCS port)?

Runs in the CLI process (`pdserve up`, through `deploy.ray_launcher`). Pure functions over plain
values (no Ray import), so they are unit-tested without a cluster:

- `local_cluster_cpus`: how many CPUs a local Ray cluster that `pdserve up` starts itself gets:
  enough for every worker's bundle even on a smaller machine (the workers then share cores),
  with one line saying so;
- `placement_problem`: on a cluster that already exists, why the workers' bundles can never be
  placed (too few CPUs/GPUs in total, or no node big enough for one bundle), naming the fix —
  instead of waiting `ray.start_timeout_s` for a placement that cannot happen;
- `redis_ray_collision`: a `redis://` URL that reaches Ray's GCS (`ray start --head` listens on
  6379, Redis's default port, unless told otherwise).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from urllib.parse import urlsplit

LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0"})


def local_cluster_cpus(
    num_workers: int, cpus_per_worker: float, asked: int | None, machine_cpus: int
) -> tuple[int, str | None]:
    """CPUs for a local Ray cluster: `asked` (ray.num_cpus) when set, else the machine's — raised
    to what `num_workers` bundles of `cpus_per_worker` need. Returns (cpus, note): `note` is one
    line for the user when the cluster is sized past the machine, else None."""
    need = math.ceil(num_workers * cpus_per_worker)
    have = asked if asked is not None else machine_cpus
    if need <= have:
        return have, None
    return need, (
        f"starting a local Ray cluster with {need} CPUs for {num_workers} workers x "
        f"ray.cpus_per_worker={cpus_per_worker:g} (this machine has {machine_cpus}: the workers "
        f"share its cores)"
    )


def placement_problem(
    bundle: Mapping[str, float], count: int, nodes: Sequence[Mapping[str, float]]
) -> str | None:
    """Why `count` bundles of `bundle` (e.g. {"CPU": 1}) can never be placed on a cluster whose
    alive nodes have `nodes` total resources, or None when they can be (perhaps after others
    free theirs). Checks the sum over nodes and that one bundle fits on some node."""
    fields = {"CPU": "ray.cpus_per_worker", "GPU": "ray.gpus_per_worker"}
    for res, per in bundle.items():
        if per <= 0:
            continue
        total = sum(n.get(res, 0.0) for n in nodes)
        need = per * count
        what = fields.get(res, res)
        if total < need:
            return (
                f"Ray cannot place {count} workers x {{'{res}': {per:g}}}: the cluster has "
                f"{total:g} {res} in all (need {need:g}); lower {what}, start fewer workers, "
                f"or add nodes"
            )
        biggest = max((n.get(res, 0.0) for n in nodes), default=0.0)
        if biggest < per:
            return (
                f"Ray cannot place a worker needing {{'{res}': {per:g}}}: the largest node has "
                f"{biggest:g} {res}; lower {what}"
            )
    return None


def redis_ray_collision(
    redis_url: str, ray_gcs_address: str, this_host: str = "127.0.0.1"
) -> str | None:
    """An error naming the fix when `redis_url` reaches Ray's GCS (`host:port`) from this
    process, else None. A loopback Redis host is this machine: it collides when the GCS runs
    here too (its host is loopback or `this_host`, this node's IP). `unix://` never collides."""
    url = urlsplit(redis_url)
    if url.scheme not in ("redis", "rediss"):
        return None
    host = url.hostname or "127.0.0.1"
    port = url.port or 6379
    gcs_host, _, gcs_port = ray_gcs_address.rpartition(":")
    gcs_host = gcs_host.strip("[]")
    if not gcs_port.isdigit() or int(gcs_port) != port:
        return None
    gcs_here = gcs_host in LOOPBACK or gcs_host == this_host
    if host == gcs_host or (host in LOOPBACK and gcs_here):
        return (
            f"router.prefix_index.url={redis_url!r} is Ray's GCS address {ray_gcs_address}, "
            f"not a Redis server: run Redis on another port (e.g. redis-server --port 6380) and "
            f"point the URL there"
        )
    return None
