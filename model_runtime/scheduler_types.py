"""The scheduler's plain data: its limits and one step's plan. Pure: no torch, no I/O.

Shared by the colocated `Scheduler` (which builds `SchedulerOutput`s), the engine (which runs
them) and the worker roles (which read them in `before_forward` hooks).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from model_runtime.sampling_params import TopLogprobs

AcceptedToken = tuple[int, float, TopLogprobs | None]
"""A verified proposal a step kept: (token id, its logprob, its top alternatives or None)."""


@dataclass(frozen=True)
class SchedulerConfig:
    """Limits of one colocated scheduler; validated by the engine's config."""

    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running request decodes each step"
            )


@dataclass(frozen=True)
class ScheduledRequest:
    """One request's share of a step: run `token_ids` at positions `start_pos ..`.

    `block_table` covers at least positions `[0, start_pos + len(token_ids))`. `samples` is
    True when the chunk ends at the request's last known token, so its logits give the next
    token; partial prefill chunks have `samples=False` and their logits are ignored.
    `num_lookahead` (decoding rows only): how many proposed tokens the step may verify after
    `token_ids` (speculative decoding); `block_table` covers those positions too.
    """

    request_id: str
    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    samples: bool
    num_lookahead: int = 0


@dataclass(frozen=True)
class SchedulerOutput:
    """One step: the items to run, in batch order, and the requests preempted to make room."""

    items: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(len(item.token_ids) for item in self.items)
