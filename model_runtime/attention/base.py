"""The attention-backend seam. Runs inside the engine thread of every worker.

The model runner flattens a step's sequences into one token dimension ``T`` and describes them
with an `AttentionMetadata`. For every layer the backend's `forward`:

1. writes the step's new K/V into the paged cache at `slot_mapping` (so the cache holds every
   token of every sequence up to `seq_lens[i]` once `forward` returns — the KV transfer relies
   on this to send a layer as soon as its forward is done); on an int8 cache (`kv_scales`
   given) it quantizes them there (`model_runtime.kv_quant.quantize`: int8 values plus one
   float16 scale per token per head);
2. computes causal attention of each new query over its sequence's whole context, read back
   from the cache (on an int8 cache: the dequantized values, in float32, including the
   step's own tokens, so a token's attention never depends on whether its context was
   computed in this step, an earlier chunk, or came from the prefix cache or a KV transfer).

`prepare` is called once per step (before layer 0) to build whatever index tensors the backend
shares across layers. Backends do no I/O and keep no per-request state between steps.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from model_runtime.kv_quant import quantize


@dataclass
class AttentionMetadata:
    """Where a step's tokens come from and go to. Sequences appear in batch order.

    Sequence i's new tokens are rows ``query_start_loc[i] : query_start_loc[i+1]`` of the
    flattened batch; they sit at positions ``seq_lens[i] - query_lens[i] .. seq_lens[i] - 1``.
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token
    query_start_loc: list[int]  # [B+1] cumulative new-token offsets
    query_lens: list[int]  # [B] new tokens this step
    seq_lens: list[int]  # [B] tokens in context after this step (cached + new)
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0
    seq_lens_tensor: torch.Tensor  # [B] int32, same values as seq_lens
    decode_indices: list[int]  # sequences with query_len == 1 (batched together)
    prefill_indices: list[int]  # the others


class AttentionBackend(Protocol):
    """One attention implementation. See the module docstring for the contract."""

    name: str

    def prepare(self, meta: AttentionMetadata) -> None:
        """Build per-step state shared by all layers (called once per step)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,  # [T, num_kv_heads, head_dim]
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into the caches at meta.slot_mapping, then attend (causal, paged).

        `kv_scales`: an int8 cache's (key, value) scales [num_blocks, block_size,
        num_kv_heads] float16 (`KVCache.layer`); the caches are then int8 and the output is in
        q's dtype."""
        ...


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    rows: torch.Tensor | None = None,
    kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Store new tokens' K/V at their slots (slot = block_id * block_size + offset).

    The caches may be strided over blocks (`KVCache.layer`: K and V halves interleave block by
    block); within a block, rows must be contiguous. `rows` is `slot_rows(key_cache,
    slot_mapping)` when the caller has it already (it is the same for every layer of a step).
    With `kv_scales` (an int8 cache) k and v are quantized (`kv_quant.quantize`) into the int8
    caches and their scales; `rows` is not used.
    """
    if kv_scales is not None:
        _write_quantized(k, v, key_cache, value_cache, slot_mapping, kv_scales)
        return
    if rows is None:
        rows = slot_rows(key_cache, slot_mapping)
    _token_rows(key_cache).index_copy_(0, rows, k)
    _token_rows(value_cache).index_copy_(0, rows, v)


def _write_quantized(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[torch.Tensor, torch.Tensor],
) -> None:
    """`write_kv` into an int8 cache: values and scales at (block, offset) of each slot."""
    block_size = key_cache.shape[1]
    where = (slot_mapping // block_size, slot_mapping % block_size)
    for x, cache, scales in ((k, key_cache, kv_scales[0]), (v, value_cache, kv_scales[1])):
        q, s = quantize(x)
        cache.index_put_(where, q)
        scales.index_put_(where, s)


def _token_rows(cache: torch.Tensor) -> torch.Tensor:
    """A [rows, H, D] view of a [num_blocks, bs, H, D] cache whose block stride is a multiple
    m of the block's size: row ``b * m * bs + o`` is token offset o of block b."""
    num_blocks, block_size, num_kv_heads, head_dim = cache.shape
    row = num_kv_heads * head_dim
    if cache.stride()[1:] != (row, head_dim, 1) or cache.stride(0) % (block_size * row):
        raise ValueError(f"cache rows must be contiguous within a block, got {cache.stride()}")
    m = cache.stride(0) // (block_size * row)
    return cache.as_strided(
        ((num_blocks - 1) * m * block_size + block_size, num_kv_heads, head_dim),
        (row, head_dim, 1),
        cache.storage_offset(),
    )


def slot_rows(cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """The row of each slot in `write_kv`'s row view of `cache` (depends only on the slots
    and the cache's block stride, so one step computes it once for all layers)."""
    _, block_size, num_kv_heads, head_dim = cache.shape
    m = cache.stride(0) // (block_size * num_kv_heads * head_dim)
    if m == 1:
        return slot_mapping
    return slot_mapping + (slot_mapping // block_size) * ((m - 1) * block_size)
