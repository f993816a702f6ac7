"""The simulator's data: requests, the simulated cluster, what a client measured, attainment.

Pure data (no I/O); used by the simulator (`sim.py`), the planner, the validation replay and
the cluster-scale experiments. Times are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (s after t=0), prompt and output lengths (tokens, >= 1)."""

    arrival_s: float
    input_len: int
    output_len: int


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated cluster. Engine settings are per worker, as in `EngineConfig`.

    Disaggregated (`prefill` >= 1 and `decode` >= 1, `colocated` = 0) or colocated
    (`colocated` >= 1, no prefill or decode workers). `chunk_tokens` is a worker's step budget
    (`max_num_batched_tokens`: prompt chunks, and on a colocated worker its decode rows too).
    `threads`: cores one worker's step keeps busy (CPU sharing only). `nodes`: the node label
    of each worker, in worker order (prefill first, then decode; empty = one node).
    `role_switch_s`: how long a drained worker takes to come back in its new role.
    `max_inflight` / `max_queued`: the router's admission limits (running; waiting beyond, and
    None = no bound): a request that finds the queue full fails at once (RESOURCE_EXHAUSTED).
    """

    prefill: int
    decode: int
    chunk_tokens: int = 256
    max_num_seqs: int = 32
    num_kv_blocks: int = 1024
    block_size: int = 16
    chunked: bool = True
    max_inflight: int = 64
    max_queued: int | None = None
    cores: float | None = None
    colocated: int = 0
    threads: float = 1.0
    nodes: tuple[str, ...] = ()
    role_switch_s: float = 0.0

    def __post_init__(self) -> None:
        if self.colocated:
            if self.colocated < 0 or self.prefill or self.decode:
                raise ValueError(
                    f"a colocated cluster has colocated >= 1 and no prefill/decode workers, got "
                    f"{self.prefill}:{self.decode} + {self.colocated} colocated"
                )
        elif self.prefill < 1 or self.decode < 1:
            raise ValueError(
                f"need >= 1 prefill and decode worker, got {self.prefill}:{self.decode}"
            )
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"cores must be > 0 or None, got {self.cores}")
        if self.threads <= 0:
            raise ValueError(f"threads must be > 0, got {self.threads}")
        if self.nodes and len(self.nodes) != self.workers:
            raise ValueError(f"nodes must name all {self.workers} workers, got {len(self.nodes)}")
        if self.chunk_tokens < 1 or self.max_num_seqs < 1 or self.num_kv_blocks < 1:
            raise ValueError(
                "chunk_tokens, max_num_seqs and num_kv_blocks must be >= 1, got "
                f"{self.chunk_tokens}, {self.max_num_seqs}, {self.num_kv_blocks}"
            )

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def mode(self) -> str:
        return "colocated" if self.colocated else "disagg"

    @property
    def label(self) -> str:
        """'3:5' (prefill:decode) or 'colocated x4'."""
        return f"colocated x{self.colocated}" if self.colocated else f"{self.prefill}:{self.decode}"


@dataclass
class SimOutcome:
    """What a client would have measured for one request (seconds; None when not reached)."""

    ok: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    end_s: float | None = None


def attainment(
    outcomes: Sequence[SimOutcome], slo_ttft_s: float, slo_tpot_s: float
) -> tuple[float, float, float]:
    """(TTFT, TPOT, both) attainment, the goodput bench's definition (failed requests miss
    both; a one-token request has no TPOT and meets it). 1.0 each for no requests."""
    if not outcomes:
        return 1.0, 1.0, 1.0
    ttft = [o.ok and o.ttft_s is not None and o.ttft_s <= slo_ttft_s for o in outcomes]
    tpot = [o.ok and (o.tpot_s is None or o.tpot_s <= slo_tpot_s) for o in outcomes]
    n = len(outcomes)
    both = sum(a and b for a, b in zip(ttft, tpot, strict=True))
    return sum(ttft) / n, sum(tpot) / n, both / n
