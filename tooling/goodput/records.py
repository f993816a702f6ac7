"""Data contracts of the goodput benchmark: what a run asks for and what it measured.

Pure data, no I/O beyond (de)serialising to JSON-able dicts; used by the orchestrator and by
the load generator process, which exchange them as JSON files.

- `RequestSpec`: one request of a workload: when it is sent (seconds after the run starts),
  how many prompt tokens, how many output tokens (sent as `max_tokens` with `ignore_eos`), and
  an optional prefix group (requests of one group share their first `prefix_len` tokens).
- `RequestRecord`: what the client measured for one request, plus the server's timings.
- `RunResult`: every record of one run at one rate against one configuration, the load
  generator's own send lag, and the run's wall-clock span.

All times in records are milliseconds, except `scheduled_s` / `sent_s` / `duration_s`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

TIMING_FIELDS = (
    "router_queue_ms",
    "prefill_queue_ms",
    "prefill_compute_ms",
    "kv_transfer_ms",
    "decode_admission_ms",
    "first_decode_step_ms",
)
"""The server-side TTFT breakdown, in the order the request passes through them."""

SEND_LAG_LIMIT_MS = 10.0
"""A run whose p99 send lag exceeds this is invalid: the load generator, not the server, set
the arrival times."""


@dataclass(frozen=True)
class RequestSpec:
    """One request of a workload. `prefix_group` None = nothing shared; otherwise the first
    `prefix_len` prompt tokens come from the group's token stream (`prefix_len` None = the whole
    prompt, which is how a multi-turn conversation's next turn extends the previous one)."""

    index: int
    arrival_s: float
    input_len: int
    output_len: int
    prefix_group: int | None = None
    prefix_len: int | None = None

    def __post_init__(self) -> None:
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(
                f"request {self.index}: input_len and output_len must be >= 1, got "
                f"{self.input_len} and {self.output_len}"
            )
        if self.arrival_s < 0:
            raise ValueError(f"request {self.index}: arrival_s must be >= 0, got {self.arrival_s}")
        if self.prefix_len is not None and not 0 <= self.prefix_len <= self.input_len:
            raise ValueError(
                f"request {self.index}: prefix_len must be in [0, input_len={self.input_len}], "
                f"got {self.prefix_len}"
            )

    @property
    def shared_len(self) -> int:
        """Prompt tokens taken from the prefix group's stream (0 without a group)."""
        if self.prefix_group is None:
            return 0
        return self.input_len if self.prefix_len is None else self.prefix_len


@dataclass
class RequestRecord:
    """One request as the client saw it. `status` is "OK" or a gRPC status name; a request is
    a success only when `status == "OK"` and every requested token arrived.

    Client-side: `ttft_ms` = send -> first token; `tpot_ms` = (last - first token) / (n - 1),
    None with fewer than two tokens; `itl_ms` = gaps between consecutive response messages
    (one token each, normally); `e2e_ms` = send -> last message. `server` holds the router's
    `Timings` (ttft_ms, the breakdown in `TIMING_FIELDS`, e2e_ms); empty on errors.
    `prefill_path`: where the router had the prompt prefilled (`FinalInfo.prefill_path`)."""

    index: int
    request_id: str
    scheduled_s: float
    sent_s: float
    input_len: int
    output_len: int
    prefix_group: int | None = None
    status: str = "OK"
    error: str = ""
    num_tokens: int = 0
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)
    finish_reason: str = ""
    cached_tokens: int = 0
    server: dict[str, float] = field(default_factory=dict)
    prefill_worker: str = ""
    decode_worker: str = ""
    prefill_path: str = ""  # disagg: "remote" | "local" (hybrid, `router.hybrid`); "" colocated

    @property
    def send_lag_ms(self) -> float:
        """How late the load generator sent this request (ms after its scheduled time)."""
        return (self.sent_s - self.scheduled_s) * 1e3

    @property
    def ok(self) -> bool:
        return self.status == "OK" and self.num_tokens >= self.output_len

    @property
    def end_s(self) -> float:
        """When the request ended, seconds after the run started (send time on errors)."""
        return self.sent_s + (self.e2e_ms or 0.0) / 1e3

    def close(self, t_sent: float, first: float | None, prev: float | None, end: float) -> None:
        """Finish a streamed record on the client's clock: `first` / `prev` = arrival of the
        first / last token message (None: no token), `end` = the stream's end. A short OK
        stream becomes INCOMPLETE; TTFT, TPOT and e2e are set from the times."""
        if self.status == "OK" and self.num_tokens < self.output_len:
            self.status, self.error = "INCOMPLETE", f"{self.num_tokens} of {self.output_len} tokens"
        if first is not None:
            self.ttft_ms = (first - t_sent) * 1e3
            if self.num_tokens > 1 and prev is not None and prev > first:
                self.tpot_ms = (prev - first) * 1e3 / (self.num_tokens - 1)
        self.e2e_ms = (end - t_sent) * 1e3

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RequestRecord:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass
class RunResult:
    """One run: one configuration at one offered rate (or a trace replay). `duration_s` spans
    from the run's start (t = 0, the first scheduled arrival) to the end of its last request."""

    config: str
    rate: float
    arrival: str
    seed: int
    token_seed: int
    records: list[RequestRecord]
    duration_s: float
    send_lag_p50_ms: float
    send_lag_p99_ms: float
    meta: dict[str, Any] = field(default_factory=dict)
    t0_monotonic: float = 0.0
    """The run's t = 0 on the load generator's clock (`time.monotonic`, system-wide on Linux),
    so samples taken by another process on the same host can be aligned with its records."""

    @property
    def valid(self) -> bool:
        """False when the load generator itself was late (p99 send lag above the limit)."""
        return self.send_lag_p99_ms <= SEND_LAG_LIMIT_MS

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "records"}
        out["valid"] = self.valid
        out["records"] = [r.to_json() for r in self.records]
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        names = {f.name for f in fields(cls)} - {"records"}
        kw = {k: v for k, v in data.items() if k in names}
        return cls(records=[RequestRecord.from_json(r) for r in data["records"]], **kw)
