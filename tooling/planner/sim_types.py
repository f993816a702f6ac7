"""The simulator's data: requests, the simulated cluster, what a client measured, attainment.

Pure data (no I/O); used by the simulator (`sim.py`), the planner, the validation replay and
the cluster-scale experiments. Times are seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tooling.goodput.analysis import LongPromptSLO


@dataclass(frozen=True)
class SimRequest:
    """One request: arrival (s after t=0), prompt and output lengths (tokens, >= 1).
    `tokens`: its prompt's token ids, for prefix-cache hits between requests (empty: a prompt
    that shares nothing with any other request's)."""

    arrival_s: float
    input_len: int
    output_len: int
    tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.tokens and len(self.tokens) != self.input_len:
            raise ValueError(f"{len(self.tokens)} prompt tokens for input_len {self.input_len}")


@dataclass(frozen=True)
class ClusterSpec:
    """The simulated cluster. Engine settings are per worker, as in `EngineConfig`.

    Disaggregated (`prefill` >= 1 and `decode` >= 1, `colocated` = 0) or colocated
    (`colocated` >= 1, no prefill or decode workers). `chunk_tokens` is a worker's step budget
    (`max_num_batched_tokens`: prompt chunks, and on a colocated worker its decode rows too).
    `threads`: cores one worker's step keeps busy (CPU sharing only). `nodes`: the node label
    of each worker, in worker order (prefill first, then decode; empty = one node).
    `role_switch_s`: how long a drained worker takes to come back in its new role.
    `hybrid_threshold` (disaggregated only): hybrid — a request whose uncached prompt is at most
    this many tokens may prefill on its decode worker (the decision: `sim_routing.Choose`,
    by default `threshold_rule`); None: every request goes through a prefill worker.
    `prefix_caching`: the workers' block pools keep a prefix cache (the engine's default).
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
    hybrid_threshold: int | None = None
    prefix_caching: bool = True

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
        if self.hybrid_threshold is not None and (self.colocated or self.hybrid_threshold < 0):
            raise ValueError(
                f"hybrid_threshold needs a disaggregated cluster and >= 0, got "
                f"{self.hybrid_threshold} on {self.label}"
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
        if self.colocated:
            return "colocated"
        return "disagg" if self.hybrid_threshold is None else "hybrid"

    @property
    def label(self) -> str:
        """'3:5' (prefill:decode), '3:5 hybrid<=256' or 'colocated x4'."""
        if self.colocated:
            return f"colocated x{self.colocated}"
        hybrid = "" if self.hybrid_threshold is None else f" hybrid<={self.hybrid_threshold}"
        return f"{self.prefill}:{self.decode}{hybrid}"


@dataclass
class SimOutcome:
    """What a client would have measured for one request (seconds; None when not reached)."""

    ok: bool = False
    ttft_s: float | None = None
    tpot_s: float | None = None
    end_s: float | None = None
    path: str = ""  # how it was served: colocated | local | remote ("": not started)
    input_len: int = 0  # its prompt's tokens (which SLO class judges it)


def attainment(
    outcomes: Sequence[SimOutcome],
    slo_ttft_s: float,
    slo_tpot_s: float,
    long_prompt: LongPromptSLO | None = None,
) -> tuple[float, float, float]:
    """(TTFT, TPOT, both) attainment, the goodput bench's definition (failed requests miss
    both; a one-token request has no TPOT and meets it; with `long_prompt`, a request whose
    prompt has >= its `min_prompt_tokens` is judged by its SLOs instead). 1.0 each for no
    requests."""
    if not outcomes:
        return 1.0, 1.0, 1.0

    def slos(o: SimOutcome) -> tuple[float, float]:
        if long_prompt is not None and long_prompt.judges(o.input_len):
            return long_prompt.ttft_ms / 1e3, long_prompt.tpot_ms / 1e3
        return slo_ttft_s, slo_tpot_s

    judged = [(o, *slos(o)) for o in outcomes]
    ttft = [o.ok and o.ttft_s is not None and o.ttft_s <= t for o, t, _ in judged]
    tpot = [o.ok and (o.tpot_s is None or o.tpot_s <= p) for o, _, p in judged]
    n = len(outcomes)
    both = sum(a and b for a, b in zip(ttft, tpot, strict=True))
    return sum(ttft) / n, sum(tpot) / n, both / n
