"""The configurations a goodput benchmark compares, as local clusters. Orchestrator process.

Three named configurations with the same total torch threads (`threads`, default 2) and the
same model, block size, KV blocks and batch limits:

| name | workers | torch threads | prefill |
|---|---|---|---|
| `colocated` | 1 colocated | `threads` | chunked, `chunk_tokens` per step |
| `colocated-nochunk` | 1 colocated | `threads` | whole prompts (step budget = context + seqs) |
| `disagg` | 1 prefill + 1 decode | `threads // 2` each | chunked, `chunk_tokens` per step |
| `hybrid` | 1 prefill + 1 decode | `threads // 2` each | as `disagg`, short prompts on D |
| `colocated-spec`, `disagg-spec` | as `colocated`, `disagg` | | + speculative decoding |

`hybrid` is `disagg` with `[router.hybrid]` on: prompts of at most
`HYBRID_LOCAL_PREFILL_TOKENS` uncached tokens are prefilled on the decode worker itself
(unless the decode worker has more work than the prefill worker: the section's default
`spill_to_prefill`).

The `-spec` configurations are their base with `[engine.speculative]` = `SPECULATIVE` (the
n-gram proposer, k = 4): `pdserve bench --configs disagg,disagg-spec` measures what speculative
decoding does to a workload's goodput, and the report pairs each with its base by seed.

`bench` compares the first three by default (`DEFAULT_CONFIGS`); `hybrid` is asked for by name
(`--configs`); `pdserve demo` compares colocated and disagg (`--configs` for more).

`start_clusters` launches them with the launch function it is given (`tooling.launch`; deploy's
`tool_launchers.launch_cluster` starts router + workers as local processes), all at once, so
runs can interleave configurations without restarts; `ClusterSet.stop()` (also on exit from
the context manager) stops every process it started, by PID. An idle cluster's workers only
answer the router's status polls, so the others barely disturb a run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tooling.launch import Cluster, LaunchCluster

CONFIG_NAMES = (
    "colocated",
    "colocated-nochunk",
    "disagg",
    "hybrid",
    "colocated-spec",
    "disagg-spec",
)
SPEC_SUFFIX = "-spec"
SPECULATIVE: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 4}
"""`[engine.speculative]` of the `-spec` configurations."""
DEFAULT_CONFIGS = ("colocated", "colocated-nochunk", "disagg")
HYBRID_LOCAL_PREFILL_TOKENS = 128
"""`hybrid`'s `router.hybrid.local_prefill_max_tokens`: short prompts skip the prefill hop."""


@dataclass(frozen=True)
class EngineSizing:
    """Engine settings shared by every compared configuration."""

    context: int  # longest prompt + output the workload sends (tokens)
    chunk_tokens: int = 256
    block_size: int = 16
    num_kv_blocks: int = 1024
    max_num_seqs: int = 32
    device: str = "cpu"  # every worker's torch device ("cuda" on a GPU machine)


def cluster_overrides(name: str, sizing: EngineSizing, threads: int = 2) -> dict[str, Any]:
    """Dotted `ClusterConfig` keys of configuration `name` (ValueError for an unknown one)."""
    if name not in CONFIG_NAMES:
        raise ValueError(f"configuration must be one of {CONFIG_NAMES}, got {name!r}")
    if name.endswith(SPEC_SUFFIX):
        base = cluster_overrides(name.removesuffix(SPEC_SUFFIX), sizing, threads)
        base["engine"]["speculative"] = dict(SPECULATIVE)
        return base
    if threads < 2 and name in ("disagg", "hybrid"):
        raise ValueError(f"{name} needs threads >= 2 (one per worker), got {threads}")
    engine: dict[str, Any] = {
        "block_size": sizing.block_size,
        "num_kv_blocks": sizing.num_kv_blocks,
        "max_num_seqs": sizing.max_num_seqs,
        "max_num_batched_tokens": max(sizing.chunk_tokens, sizing.max_num_seqs),
        "enable_chunked_prefill": True,
        "device": sizing.device,
    }
    out: dict[str, Any] = {"launcher": "process", "router.port": 0, "engine": engine}
    if name in ("disagg", "hybrid"):
        out |= {"mode": "disagg", "workers.prefill": 1, "workers.decode": 1}
        out["torch_threads"] = threads // 2
        if name == "hybrid":
            out["router.hybrid"] = {"local_prefill_max_tokens": HYBRID_LOCAL_PREFILL_TOKENS}
        return out
    out |= {"mode": "colocated", "workers.colocated": 1, "torch_threads": threads}
    out["workers.prefill"] = out["workers.decode"] = 0
    if name == "colocated-nochunk":
        engine["enable_chunked_prefill"] = False
        engine["max_num_batched_tokens"] = sizing.context + sizing.max_num_seqs
    return out


def cluster_settings(
    name: str, model: Path, sizing: EngineSizing, threads: int = 2, **extra: Any
) -> dict[str, Any]:
    """The dotted cluster-config overrides of configuration `name` for `model`; `extra` adds
    more (the launch function validates them)."""
    return {"model": str(model), **cluster_overrides(name, sizing, threads), **extra}


@dataclass(frozen=True)
class OpenAITarget:
    """An OpenAI-compatible server to bench: base URL (``http://host:port/v1``), model name,
    and the vocabulary its token-id prompts are drawn from."""

    url: str
    model: str
    vocab_size: int


@dataclass
class ClusterSet:
    """Running clusters by configuration name; `address(name)` is the router to load (a gRPC
    host:port), or for an `openai` entry the server's /v1 URL (`job_fields` says which)."""

    clusters: dict[str, Cluster] = field(default_factory=dict)
    external: dict[str, str] = field(default_factory=dict)
    openai: dict[str, OpenAITarget] = field(default_factory=dict)

    @property
    def names(self) -> list[str]:
        """Every configuration, external and OpenAI ones first."""
        return [*self.external, *self.openai, *self.clusters]

    def address(self, name: str) -> str:
        if name in self.external:
            return self.external[name]
        if name in self.openai:
            return self.openai[name].url
        return self.clusters[name].address

    def pids(self, name: str) -> dict[str, int]:
        """{label: pid} of a launched configuration's processes: "router" and each worker as
        "<role>-<id>" (empty for an external cluster or OpenAI server: its processes are not
        ours to read)."""
        if name in self.external or name in self.openai:
            return {}
        c = self.clusters[name]
        pids = c.labelled_pids()
        out = {"router": pids["router"]}
        for w in c.members():
            out[f"{w.role}-{w.worker_id}"] = pids[w.worker_id]
        return out

    def job_fields(self, name: str) -> dict[str, Any]:
        """`LoadJob` fields that say how to reach `name` (none for pdserve's gRPC API)."""
        target = self.openai.get(name)
        if target is None:
            return {}
        return {"api": "openai", "model": target.model, "vocab_size": target.vocab_size}

    def describe(self) -> dict[str, Any]:
        """JSON-able description of each configuration (effective cluster config)."""
        out: dict[str, Any] = {
            n: {"address": a, "external": True} for n, a in self.external.items()
        }
        for n, t in self.openai.items():
            out[n] = {"address": t.url, "external": True, "api": "openai", "model": t.model}
        for n, c in self.clusters.items():
            out[n] = {"config": c.effective_config(), "pids": list(c.labelled_pids().values())}
        return out

    def stop(self) -> None:
        for c in self.clusters.values():
            c.stop()
        self.clusters.clear()


@contextlib.contextmanager
def start_clusters(
    names: Sequence[str],
    model: Path,
    sizing: EngineSizing,
    log_dir: Path,
    launch: LaunchCluster[Cluster],
    threads: int = 2,
    **extra: Any,
) -> Iterator[ClusterSet]:
    """Launch a local cluster per configuration name with `launch`; stop all of them on exit
    (and on a failure to start any of them)."""
    settings = {n: cluster_settings(n, model, sizing, threads, **extra) for n in names}
    running = ClusterSet()
    try:
        for name, overrides in settings.items():
            folder = log_dir / name
            folder.mkdir(parents=True, exist_ok=True)
            running.clusters[name] = launch(overrides, folder)
        yield running
    finally:
        running.stop()
