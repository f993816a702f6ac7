"""`EngineConfig`: how an engine is sized and batched. Torch-free.

Lives apart from `model_runtime.engine` so that processes that only read or validate configs
(the `pdserve up` process hosting the router, config tests) never import torch.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from model_runtime.speculative.config import SpeculativeConfig


class EngineConfig(BaseModel):
    """How a colocated engine is sized and batched. Frozen; discovered values (the resolved
    number of KV blocks, the model's EOS ids) live on the engine, not here."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    block_size: int = Field(default=16, gt=0, description="Tokens per KV block.")
    num_kv_blocks: int | None = Field(
        default=None,
        gt=0,
        description="KV blocks to allocate; None derives it from kv_cache_memory_mb.",
    )
    kv_cache_memory_mb: float = Field(
        default=256.0,
        gt=0,
        description="KV cache size in MiB, used only when num_kv_blocks is None "
        "(blocks = memory // KVCache.bytes_per_block, which counts kv_cache_dtype's bytes: an "
        "int8 cache holds about 1.9x the blocks of a bfloat16 one in the same memory).",
    )
    max_num_batched_tokens: int = Field(
        default=512, gt=0, description="Token budget of one step (decode tokens + prefill chunks)."
    )
    max_num_seqs: int = Field(default=64, gt=0, description="Most requests running at once.")
    enable_chunked_prefill: bool = Field(
        default=True,
        description="Split prompts into chunks that fill the step budget; off: a prompt "
        "runs whole in one step or waits.",
    )
    enable_prefix_caching: bool = Field(
        default=True,
        description="Reuse the KV of full prompt blocks already computed (hash chain).",
    )
    attention_backend: Literal["auto", "torch", "cpu", "triton"] = Field(
        default="auto",
        description="'auto' = Triton on CUDA when importable; on CPU 'cpu' (compiled decode "
        "attention) where its kernel builds, else 'torch' (the reference).",
    )
    linear_kernel: Literal["auto", "torch", "onednn", "avx2"] = Field(
        default="auto",
        description="GEMM behind the weight matmuls; 'auto' = on AVX2-only CPUs the avx2 panel "
        "kernel (every step; decode steps fused in one C call); on CPUs with oneDNN's wider "
        "paths (AVX-512, AMX) oneDNN prepacked weights for prefill and mixed steps plus a "
        "panel copy of the weights (2x weight memory) on which decode-only steps run fused; "
        "elsewhere torch's F.linear. 'onednn' = oneDNN for every step, one copy; 'avx2' = "
        "the panel kernel for every step, one copy.",
    )
    quant_activations: Literal["auto", "int8", "float32"] = Field(
        default="auto",
        description="Weights kept quantized (a folder with a quantization_config): how the "
        "decode GEMMs multiply them. 'int8' quantizes each activation row to int8 per "
        "32-value block and multiplies with AVX-512 VNNI (llama.cpp's way; greedy output "
        "agrees with float32 up to near-ties, not bit for bit); 'float32' dequantizes the "
        "weights in registers and multiplies in fp32 (the dequantized model's function up to "
        "summation order); 'auto' = 'int8' where the CPU has AVX-512 VNNI, else 'float32'.",
    )
    device: str = Field(
        default="cpu", description="torch device of model and KV cache, e.g. 'cuda:0'."
    )
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        default="auto", description="Weights/KV dtype; 'auto' = the checkpoint's torch_dtype."
    )
    kv_cache_dtype: Literal["auto", "int8"] = Field(
        default="auto",
        description="How KV blocks are stored: 'auto' = the model's dtype; 'int8' = int8 "
        "values with one float16 scale per token per KV head in the same block (quantized "
        "when written, dequantized inside attention; about half of bfloat16's bytes, so twice "
        "the blocks per MiB and half the bytes per KV transfer). Prefill and decode workers "
        "must agree (a mismatch fails the transfer naming both).",
    )
    seed: int = Field(
        default=0, ge=0, description="Seeds the generators of sampled requests that carry no seed."
    )
    speculative: SpeculativeConfig | None = Field(
        default=None,
        description="Speculative decoding on this engine's decode steps (`[engine.speculative]`, "
        "`method` 'ngram' or 'draft'); None: off. Requests opt out one by one "
        "(`SamplingParams.speculative`). Prefill-only steps never speculate.",
    )

    @model_validator(mode="after")
    def _check_budget(self) -> EngineConfig:
        if self.max_num_seqs > self.max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs ({self.max_num_seqs}) must not exceed max_num_batched_tokens "
                f"({self.max_num_batched_tokens}): every running request decodes each step"
            )
        return self
