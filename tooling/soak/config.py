"""`SoakConfig`: what one `pdserve soak` run does (cluster, load, faults). CLI / soak process.

Frozen pydantic model; every knob has a default so `SoakConfig(model=..., out=...)` is a valid
short soak. `faults` is a comma list of fault kinds, each optionally with a count
(`kill-prefill:3,stop,redis`); kinds without a count share `num_faults` (see `fault_counts`).

Fault kinds (what `tooling.soak.faults` does to the running cluster):

| kind | what |
|---|---|
| `kill-prefill` | SIGKILL a prefill worker; its launcher restarts it |
| `kill-decode` | SIGKILL a decode worker; its launcher restarts it |
| `stop` | SIGSTOP a worker for `stop_min_s`..`stop_max_s`, then SIGCONT |
| `long-stop` | SIGSTOP a worker for `long_stop_s` (default: the deadline + 10 s), then SIGCONT |
| `redis` | SIGKILL the prefix index's redis-server, start an empty one on the same port |
| `kv-stall` | SIGSTOP the decode worker that reserved KV for a short-deadline probe |

A `kv-stall` keeps that decode worker stopped until after the probe's deadline, so the probe's
KV transfer stalls past its deadline. A `long-stop` outlasts every request's deadline: a request
placed on the stopped worker, at whatever phase, must be moved within the router's
`stall_timeout_s`, which the checks hold it to (`stall_slack_s`, `check.judge`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

FaultKind = Literal["kill-prefill", "kill-decode", "stop", "long-stop", "redis", "kv-stall"]
FAULT_KINDS: tuple[FaultKind, ...] = (
    "kill-prefill",
    "kill-decode",
    "stop",
    "long-stop",
    "redis",
    "kv-stall",
)
STOP_KINDS = frozenset({"stop", "long-stop"})  # SIGSTOP a worker for the fault's duration
DEFAULT_FAULTS = ",".join(FAULT_KINDS)
_TOPOLOGY = re.compile(r"^(\d+)p(\d+)d$")


def parse_topology(value: str) -> tuple[int, int]:
    """'2p2d' -> (2, 2); ValueError naming `topology` otherwise."""
    m = _TOPOLOGY.match(value.strip().lower())
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"topology must look like '2p2d' (>= 1 of each), got {value!r}")
    return int(m.group(1)), int(m.group(2))


def parse_faults(value: str) -> list[tuple[FaultKind, int | None]]:
    """'kill-prefill:2,stop' -> [('kill-prefill', 2), ('stop', None)]; '' or 'none' -> []."""
    out: list[tuple[FaultKind, int | None]] = []
    if value.strip().lower() in ("", "none"):
        return out
    for item in value.split(","):
        name, _, count = item.strip().partition(":")
        if name not in FAULT_KINDS:
            raise ValueError(f"faults: unknown kind {name!r}; kinds are {list(FAULT_KINDS)}")
        if count and (not count.isdigit()):
            raise ValueError(f"faults: count of {name!r} must be a whole number, got {count!r}")
        out.append((name, int(count) if count else None))
    return out


class SoakConfig(BaseModel):
    """One soak run. Times are seconds; `rate` is the open-loop arrival rate in requests/s."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: Path = Field(description="HF model folder served by the cluster (tiny preset).")
    out: Path = Field(description="Run folder: soak.json, report.md, timeline.png, logs/.")
    topology: str = Field(default="2p2d", description="Workers as '<P>p<D>d'.")
    launcher: Literal["processes", "ray"] = Field(
        default="processes", description="Who starts and restarts the workers."
    )
    requests: int = Field(default=300, ge=10, description="Requests sent in total.")
    rate: float = Field(default=4.0, gt=0, description="Mean Poisson arrival rate (req/s).")
    seed: int = Field(default=0, ge=0, description="Seeds the workload and the fault schedule.")
    faults: str = Field(default=DEFAULT_FAULTS, description="Fault kinds, 'kind[:count]' list.")
    num_faults: int | None = Field(
        default=None,
        ge=0,
        description="Faults of the kinds listed without a count; None = max(5, requests // 50).",
    )
    bursts: int | None = Field(
        default=None, ge=0, description="Bursts above the queue bound; None = 1 per 300 requests."
    )
    storms: int | None = Field(
        default=None,
        ge=0,
        description="Deadline storms (10 requests with 5..95 ms deadlines at once); "
        "None = 1 per 150 requests.",
    )
    oversized: int | None = Field(
        default=None, ge=0, description="Oversized HTTP chat bodies; None = 1 per 150 requests."
    )
    oversized_mb: int = Field(
        default=10, ge=1, le=31, description="Size of an oversized chat message (MiB)."
    )
    disconnects: int | None = Field(
        default=None,
        ge=0,
        description="HTTP streams reset by their client; None = 1 per 60 requests.",
    )
    max_inflight: int = Field(default=24, ge=1, description="Router: requests running at once.")
    max_queued: int = Field(default=24, ge=0, description="Router: requests waiting beyond it.")
    default_timeout_s: float = Field(
        default=30.0, gt=0, description="Router deadline of requests that set none."
    )
    stop_min_s: float = Field(default=1.0, gt=0, description="Shortest SIGSTOP of a worker.")
    stop_max_s: float = Field(default=10.0, gt=0, description="Longest SIGSTOP of a worker.")
    long_stop_s: float | None = Field(
        default=None,
        gt=0,
        description="How long a `long-stop` fault keeps its worker stopped; None = "
        "default_timeout_s + 10 (longer than any request's deadline).",
    )
    stall_timeout_s: float = Field(
        default=3.0,
        gt=0,
        description="Router: a worker silent this long that does not answer a status call is "
        "frozen, and the request moves (`router.stall_timeout_s`).",
    )
    stall_slack_s: float = Field(
        default=3.0,
        ge=0,
        description="A request may wait on the cluster (no message, beyond the work the "
        "router's timings account for) at most stall_timeout_s + this; longer is a failure "
        "(`stalled`).",
    )
    index_ttl_s: float = Field(
        default=3.0, gt=0, description="Prefix-index TTL of a worker's entries (Redis)."
    )
    num_kv_blocks: int = Field(default=512, ge=16, description="KV blocks of every worker.")
    hang_grace_s: float = Field(
        default=2.0, gt=0, description="A request still open this long after its deadline hangs."
    )
    quiesce_timeout_s: float = Field(
        default=60.0, gt=0, description="Longest wait for rejoin, free blocks and in-flight 0."
    )
    torch_threads: int = Field(default=1, ge=1, description="torch threads per worker.")

    @field_validator("topology")
    @classmethod
    def _topology(cls, value: str) -> str:
        parse_topology(value)
        return value

    @field_validator("faults")
    @classmethod
    def _faults(cls, value: str) -> str:
        parse_faults(value)
        return value

    @model_validator(mode="after")
    def _check(self) -> SoakConfig:
        if self.stop_min_s > self.stop_max_s:
            raise ValueError(
                f"stop_min_s ({self.stop_min_s}) must not exceed stop_max_s ({self.stop_max_s})"
            )
        return self

    @property
    def long_stop_duration_s(self) -> float:
        """How long a `long-stop` fault lasts."""
        return self.long_stop_s if self.long_stop_s is not None else self.default_timeout_s + 10

    @property
    def stall_budget_s(self) -> float:
        """The longest a request may wait without a message beyond its own work."""
        return self.stall_timeout_s + self.stall_slack_s

    @property
    def counts(self) -> tuple[int, int]:
        """(prefill, decode) workers."""
        return parse_topology(self.topology)

    @property
    def num_bursts(self) -> int:
        return self.bursts if self.bursts is not None else max(1, self.requests // 300)

    @property
    def num_storms(self) -> int:
        return self.storms if self.storms is not None else max(1, self.requests // 150)

    @property
    def num_oversized(self) -> int:
        return self.oversized if self.oversized is not None else max(1, self.requests // 150)

    @property
    def num_disconnects(self) -> int:
        return self.disconnects if self.disconnects is not None else max(1, self.requests // 60)

    @property
    def burst_size(self) -> int:
        """Requests in one burst: 1.5x what the router admits (running + queued), so the
        excess must be refused with RESOURCE_EXHAUSTED."""
        return (self.max_inflight + self.max_queued) * 3 // 2

    def fault_counts(self) -> dict[FaultKind, int]:
        """How many faults of each kind: explicit counts as given, the rest of `num_faults`
        spread evenly (in list order) over the kinds listed without a count."""
        items = parse_faults(self.faults)
        total = self.num_faults if self.num_faults is not None else max(5, self.requests // 50)
        free = [k for k, n in items if n is None]
        out: dict[FaultKind, int] = {k: n for k, n in items if n is not None}
        for i, kind in enumerate(free):
            out[kind] = total // len(free) + (1 if i < total % len(free) else 0)
        return out
