"""`[engine.speculative]`: which proposer a worker's engine speculates with, and how far.
Torch-free (config-only processes validate it without importing torch).

One sub-model per proposer, chosen by `method` (the table's discriminator)::

    [engine.speculative]            [engine.speculative]
    method = "ngram"                method = "draft"
    num_speculative_tokens = 4      num_speculative_tokens = 4
    prompt_lookup_min = 2           model = "models/tiny-draft"
    prompt_lookup_max = 4           num_kv_blocks = 256

No table (`EngineConfig.speculative` None) is no speculation. The names follow vLLM's
`speculative_config` where it has one (`num_speculative_tokens`, `prompt_lookup_min`,
`prompt_lookup_max`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_SPECULATIVE_TOKENS = 16
"""Most proposals one request may verify in one step (k); each is one more row of the step."""


class _Common(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    num_speculative_tokens: int = Field(
        default=4,
        ge=1,
        le=MAX_SPECULATIVE_TOKENS,
        description="Most tokens proposed per request per step (k): the step verifies the "
        "pending token plus up to k proposals in one forward. Each request's k adapts to its "
        "recent acceptance below this (`model_runtime.speculative.adapt`).",
    )
    max_step_rows: int = Field(
        default=8,
        ge=1,
        description="Most decode rows (pending tokens plus proposals) a step may verify: "
        "proposals are granted, oldest request first, only while the step's decoding requests "
        "and the proposals granted so far stay within it. A decode step streams every weight "
        "once whatever its rows, so up to some rows each costs little; beyond them each row "
        "costs its own compute, and a proposal that is rejected costs what a token does. So "
        "a busy engine (at least this many decoding requests) does not speculate. Measure "
        "where your step stops being weight-bound (benchmarks/bench_decode_step.py).",
    )


class NgramConfig(_Common):
    """Prompt lookup: propose what followed the latest earlier occurrence of the last n tokens
    of the prompt plus the output so far (the longest n in [min, max] that occurs)."""

    method: Literal["ngram"] = "ngram"
    prompt_lookup_min: int = Field(
        default=2, ge=1, description="Shortest suffix (n tokens) looked up."
    )
    prompt_lookup_max: int = Field(
        default=4, ge=1, description="Longest suffix (n tokens) looked up; tried first."
    )

    @model_validator(mode="after")
    def _check_sizes(self) -> NgramConfig:
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"prompt_lookup_min ({self.prompt_lookup_min}) must not exceed "
                f"prompt_lookup_max ({self.prompt_lookup_max})"
            )
        return self


class DraftConfig(_Common):
    """A smaller model with the target's tokenizer, run on the same worker with its own paged
    KV cache and block pool (`model_runtime.speculative.draft`)."""

    method: Literal["draft"] = "draft"
    model: Path = Field(
        description="HF folder of the draft model (config.json + safetensors); its vocabulary "
        "must be the target's (checked at start-up)."
    )
    num_kv_blocks: int | None = Field(
        default=None,
        gt=0,
        description="The draft's KV blocks (of the engine's block_size); None: as many as the "
        "target cache has. A request whose draft KV does not fit is not speculated on.",
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto",
        description="The draft's weights/KV dtype; 'auto' = the engine's dtype.",
    )


SpeculativeConfig = Annotated[NgramConfig | DraftConfig, Field(discriminator="method")]
