"""Reference attention in plain torch: correct on any device, the oracle for the Triton kernels.

Decode sequences (one new token each) are batched into one padded gather over their block
tables and one masked `scaled_dot_product_attention`; prefill sequences (several new tokens,
possibly after a cached prefix or an earlier chunk) are handled one by one with an offset
causal mask.

On an int8 cache (`kv_scales` given) the gathered blocks are dequantized to float32
(`kv_quant.dequantize`, exact), attention runs in float32 and the output is rounded to q's
dtype once: the definition the C and Triton kernels over int8 caches are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model_runtime.attention.base import AttentionMetadata, slot_rows, write_kv
from model_runtime.kv_quant import dequantize

KVScales = tuple[torch.Tensor, torch.Tensor]


def _gather(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor) -> torch.Tensor:
    """Blocks `blocks` of one of K/V [n, block_size, H, D]: as stored, or dequantized to
    float32 with their `scales` on an int8 cache."""
    # index_select, not cache[bt]: the same gather, 4-6x faster on CPU.
    out = cache.index_select(0, blocks)
    return out if scales is None else dequantize(out, scales.index_select(0, blocks))


def paged_decode_attention(
    q: torch.Tensor,  # [B, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    seq_lens: torch.Tensor,  # [B] int
    scale: float,
    allowed: torch.Tensor | None = None,  # [B, max_blocks * block_size] bool, if precomputed
    kv_scales: KVScales | None = None,  # an int8 cache's (key, value) scales
) -> torch.Tensor:  # [B, num_heads, head_dim]
    """One query token per sequence attending over its first seq_lens[b] cached tokens.

    `allowed` is `decode_mask(seq_lens, max_blocks * block_size)`; a caller that runs many
    layers over the same sequences builds it once and passes it in."""
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    max_len = block_tables.shape[1] * block_size
    flat = block_tables.long().reshape(-1)
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    # [B, max_len, kv_heads, D] -> [B, kv_heads, max_len, D] (a view: SDPA takes strides)
    keys = _gather(key_cache, ks, flat).view(batch, max_len, num_kv_heads, head_dim)
    values = _gather(value_cache, vs, flat).view(batch, max_len, num_kv_heads, head_dim)
    keys, values = keys.transpose(1, 2), values.transpose(1, 2)
    if allowed is None:
        allowed = decode_mask(seq_lens.to(q.device), max_len)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2).to(keys.dtype),  # [B, H, 1, D]
        keys,
        values,
        attn_mask=allowed[:, None, None, :],
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(2).to(q.dtype)


def decode_mask(seq_lens: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] bool: position p of sequence b is attended to iff p < seq_lens[b]."""
    positions = torch.arange(max_len, device=seq_lens.device)
    return positions[None, :] < seq_lens.long()[:, None]


def prefill_attention(
    q: torch.Tensor,  # [n, num_heads, head_dim] new queries at positions seq_len-n .. seq_len-1
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int
    seq_len: int,
    scale: float,
    kv_scales: KVScales | None = None,  # an int8 cache's (key, value) scales
) -> torch.Tensor:  # [n, num_heads, head_dim]
    """Causal attention of n new tokens over the sequence's whole cached context."""
    n, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_blocks = -(-seq_len // block_size)
    bt = block_table[:num_blocks].long()
    ks, vs = kv_scales if kv_scales is not None else (None, None)
    keys = _gather(key_cache, ks, bt).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    values = _gather(value_cache, vs, bt).reshape(-1, num_kv_heads, head_dim)[:seq_len]
    start = seq_len - n
    q_pos = torch.arange(start, seq_len, device=q.device)
    k_pos = torch.arange(seq_len, device=q.device)
    allowed = k_pos[None, :] <= q_pos[:, None]  # [n, seq_len]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0).to(keys.dtype),  # [1, H, n, D]
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=allowed,
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    return out.squeeze(0).transpose(0, 1).to(q.dtype)


class TorchAttentionBackend:
    """`AttentionBackend` in plain torch (see `model_runtime.attention.base`)."""

    name = "torch"

    def prepare(self, meta: AttentionMetadata) -> None:
        self._decode_rows = torch.as_tensor(
            [meta.query_start_loc[i] for i in meta.decode_indices], dtype=torch.long
        ).to(meta.block_tables.device)
        idx = torch.as_tensor(meta.decode_indices, dtype=torch.long).to(meta.block_tables.device)
        self._decode_tables = meta.block_tables.index_select(0, idx)
        self._decode_lens = meta.seq_lens_tensor.index_select(0, idx)
        # Longest decode context: the gather covers the decode rows' own blocks only, not the
        # padding a long prefill in the same step puts into meta.block_tables.
        self._decode_max_len = max((meta.seq_lens[i] for i in meta.decode_indices), default=0)
        self._decode_mask: torch.Tensor | None = None  # built by the first layer's forward
        self._rows: torch.Tensor | None = None  # write_kv's rows, from the first layer's forward

    def _decode_inputs(self, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables trimmed to the decode rows' longest context, its mask), once a step."""
        if self._decode_mask is None:
            blocks = -(-self._decode_max_len // block_size)
            self._decode_tables = self._decode_tables[:, :blocks]
            self._decode_mask = decode_mask(self._decode_lens, blocks * block_size)
        return self._decode_tables, self._decode_mask

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: KVScales | None = None,
    ) -> torch.Tensor:
        if kv_scales is not None:
            write_kv(k, v, key_cache, value_cache, meta.slot_mapping, kv_scales=kv_scales)
        else:
            if self._rows is None:  # every layer of the step has the same slots and strides
                self._rows = slot_rows(key_cache, meta.slot_mapping)
            write_kv(k, v, key_cache, value_cache, meta.slot_mapping, self._rows)
        if not meta.prefill_indices:  # all decode (a decode worker's every step): rows in order
            return self._decode_attention(q, key_cache, value_cache, scale, kv_scales)
        out = torch.empty_like(q)
        if meta.decode_indices:
            out[self._decode_rows] = self._decode_attention(
                q.index_select(0, self._decode_rows), key_cache, value_cache, scale, kv_scales
            )
        for i in meta.prefill_indices:
            lo, hi = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[lo:hi] = prefill_attention(
                q[lo:hi],
                key_cache,
                value_cache,
                meta.block_tables[i],
                meta.seq_lens[i],
                scale,
                kv_scales,
            )
        return out

    def _decode_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        kv_scales: KVScales | None,
    ) -> torch.Tensor:
        """Attention of the step's decode rows `q` [num_decode, H, D], in decode-row order."""
        tables, allowed = self._decode_inputs(key_cache.shape[1])
        return paged_decode_attention(
            q, key_cache, value_cache, tables, self._decode_lens, scale, allowed, kv_scales
        )
