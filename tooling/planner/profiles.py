"""Cost profiles: what one worker's steps cost on some hardware, as data (JSON files).

Pure (json + dataclasses); runs in `pdserve plan`, `pdserve simulate` and the benchmarks.
A profile file is either a bare `CostModel` JSON (what `pdserve profile` wrote before
profiles carried more than one thread count) or a document::

    {
      "kind": "pdserve-profile/v1",
      "name": "...", "device": "cpu" | "gpu", "worker": "what one worker is",
      "costs": {"1": CostModel, "2": CostModel},     # by torch threads per worker ("1" on a GPU)
      "engine": {"num_kv_blocks": ..., "block_size": ..., "max_num_seqs": ...,
                 "chunk_tokens": ...},                # per-worker engine settings it assumes
      "kv_bytes_per_token": ...,                      # K + V bytes of one token, all layers
      "links": {"same_node_gbps": ..., "cross_node_gbps": ...},   # KV hand-off bandwidth, GB/s
      "role_switch_s": ...,                           # a drained worker's flip to its new role
      "derivation": ["how each number was obtained", ...],
      "sources": [{"url": ..., "used_for": ...}, ...]
    }

`pdserve profile` measures the CPU kind on the machine at hand; `deploy/profiles/*.json` ship
GPU-class profiles derived from published numbers, with their sources.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tooling.planner.costs import CostModel

KIND = "pdserve-profile/v1"


@dataclass(frozen=True)
class EngineDefaults:
    """Per-worker engine settings a profile assumes (the simulator's `ClusterSpec` fields)."""

    num_kv_blocks: int = 1024
    block_size: int = 16
    max_num_seqs: int = 32
    chunk_tokens: int = 256


@dataclass(frozen=True)
class Profile:
    """A loaded profile (module docstring)."""

    costs: dict[int, CostModel]
    name: str = ""
    device: str = "cpu"
    worker: str = ""
    engine: EngineDefaults = field(default_factory=EngineDefaults)
    kv_bytes_per_token: float = 0.0
    same_node_gbps: float | None = None
    cross_node_gbps: float | None = None
    role_switch_s: float = 0.0
    derivation: tuple[str, ...] = ()
    sources: tuple[dict[str, str], ...] = ()

    def cost(self, threads: int = 1) -> CostModel:
        """The cost model of a worker with `threads` torch threads; KeyError names the ones
        this profile has."""
        try:
            return self.costs[threads]
        except KeyError:
            raise KeyError(
                f"profile {self.name or '(unnamed)'} has no costs for {threads} thread(s); "
                f"it has {sorted(self.costs)} (run `pdserve profile --threads ...`)"
            ) from None

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "name": self.name,
            "device": self.device,
            "worker": self.worker,
            "costs": {str(k): v.to_json() for k, v in sorted(self.costs.items())},
            "engine": self.engine.__dict__,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "links": {
                "same_node_gbps": self.same_node_gbps,
                "cross_node_gbps": self.cross_node_gbps,
            },
            "role_switch_s": self.role_switch_s,
            "derivation": list(self.derivation),
            "sources": list(self.sources),
        }

    def save(self, path: str | Path) -> Path:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(json.dumps(self.to_json(), indent=1) + "\n")
        return p


def from_json(data: dict[str, Any]) -> Profile:
    """A `Profile` from a profile document or a bare `CostModel` JSON (ValueError when it is
    neither)."""
    if data.get("kind") != KIND:
        if "prefill" not in data or "decode" not in data:
            raise ValueError(f"not a pdserve profile (kind {data.get('kind')!r}, no cost model)")
        cost = CostModel.from_json(data)
        threads = int(cost.meta.get("threads", 1))
        return Profile(costs={threads: cost}, name=str(cost.meta.get("model", "")))
    links = data.get("links") or {}
    return Profile(
        costs={int(k): CostModel.from_json(v) for k, v in data["costs"].items()},
        name=str(data.get("name", "")),
        device=str(data.get("device", "cpu")),
        worker=str(data.get("worker", "")),
        engine=EngineDefaults(**(data.get("engine") or {})),
        kv_bytes_per_token=float(data.get("kv_bytes_per_token", 0.0)),
        same_node_gbps=links.get("same_node_gbps"),
        cross_node_gbps=links.get("cross_node_gbps"),
        role_switch_s=float(data.get("role_switch_s", 0.0)),
        derivation=tuple(data.get("derivation") or ()),
        sources=tuple(data.get("sources") or ()),
    )


def load_profile(path: str | Path) -> Profile:
    """Read a profile file (module docstring); ValueError / OSError name the file."""
    p = Path(path)
    try:
        return from_json(json.loads(p.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{p}: {exc}") from exc
