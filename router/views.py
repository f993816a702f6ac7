"""What a routing policy sees: frozen snapshots of workers (`WorkerView`) and of a request
(`RouteRequest`); the worker roles are `proto.pdserve.v1.roles`'s.

Runs in the router process. Pure data, no I/O. Below `router.policy` and `router.pair_scoring`,
which both read these views (the policy seam itself lives in `router.policy`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from model_runtime.hashing import BlockHash
from proto.pdserve.v1.roles import ROLE_NAMES, Role
from router.prefix_index.base import PrefixMatch

__all__ = ["ROLE_NAMES", "Role", "RouteRequest", "WorkerView"]


@dataclass(frozen=True)
class WorkerView:
    """A snapshot of one worker as the router sees it.

    Everything but `in_flight` comes from the worker's last `GetStatus` answer; `in_flight` is
    the number of this router's requests currently routed to the worker (fresher than the poll).
    A worker never polled successfully is `healthy=False` with zero counters.
    """

    worker_id: str
    address: str
    role: Role
    healthy: bool
    draining: bool
    num_waiting: int = 0
    num_receiving: int = 0  # of num_waiting: reservations whose KV is still to arrive (decode)
    num_running: int = 0
    waiting_tokens: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    block_size: int = 1
    in_flight: int = 0
    in_flight_prompt_tokens: int = 0  # prompt tokens of this router's `in_flight` requests
    in_flight_tokens: int = 0  # ... of which the worker must compute (minus expected hits)
    epoch: int = 0  # the worker process's start epoch (0: unknown)
    node: str = ""  # the worker's node label ("" = unlabelled: all one node)
    error: str = ""  # why it is unhealthy: the last failed poll or call ("" when healthy)

    @property
    def usable(self) -> bool:
        """Healthy and not draining: may take new work."""
        return self.healthy and not self.draining

    def why_unusable(self) -> str:
        """In words, why this worker takes no new work ("" when it is usable)."""
        if self.usable:
            return ""
        if self.healthy:
            return f"{self.address}: draining"
        return f"{self.address}: {self.error or 'not polled successfully yet'}"

    def blocks_needed(self, num_tokens: int) -> int:
        """KV blocks this worker needs to hold `num_tokens` tokens."""
        return math.ceil(num_tokens / max(self.block_size, 1))


@dataclass(frozen=True)
class RouteRequest:
    """What a policy may know about a request (no token ids: policies stay cheap).

    `block_hashes` is the hash chain of the prompt's reusable blocks (every full block except
    one holding the last token); `prefix_matches` is the prefix index's answer for it, or None
    when the index could not answer (down, slow, breaker open): route by load only then.
    """

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    colocated: bool = False
    block_hashes: tuple[BlockHash, ...] = ()
    prefix_matches: tuple[PrefixMatch, ...] | None = None

    @property
    def total_tokens(self) -> int:
        """Prompt plus the most tokens it can generate: the KV it may need."""
        return self.num_prompt_tokens + self.max_tokens
