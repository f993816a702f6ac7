"""`AttentionBackend` on Triton kernels. Runs inside the engine thread of a CUDA worker.

Importing this module imports triton; `select.get_backend` treats an ImportError as "Triton is
unavailable". The kernels live in `triton_kernels`; this class only turns an
`AttentionMetadata` into launches:

1. `write_kv_triton` stores the step's new K/V at `meta.slot_mapping`;
2. one `paged_attention_triton` launch over the decode sequences (one token each, 16-row tiles);
3. one launch over the prefill sequences (several new tokens each, 64-row tiles, causal with
   the cached prefix or earlier chunks in front).

Both launches write straight into the output rows of their sequences, so there is no gather or
scatter of q. Results equal `TorchAttentionBackend` within floating-point tolerance.
"""

from __future__ import annotations

import torch

from model_runtime.attention import triton_kernels
from model_runtime.attention.base import AttentionMetadata


class TritonAttentionBackend:
    """`AttentionBackend` (see `model_runtime.attention.base`) backed by Triton kernels."""

    name = "triton"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        """Copy this step's index tensors to the device once; every layer's `forward` reuses them.

        Keeps a reference to `meta`; `forward` must be called with the same object.
        """
        device = meta.block_tables.device
        self._meta = meta
        self._query_start_loc = torch.tensor(meta.query_start_loc, dtype=torch.int32).to(device)
        self._decode_ids = torch.tensor(meta.decode_indices, dtype=torch.int32).to(device)
        self._prefill_ids = torch.tensor(meta.prefill_indices, dtype=torch.int32).to(device)
        self._max_prefill_len = max((meta.query_lens[i] for i in meta.prefill_indices), default=0)

    def forward(
        self,
        q: torch.Tensor,  # [T, num_heads, head_dim]
        k: torch.Tensor,  # [T, num_kv_heads, head_dim]
        v: torch.Tensor,
        key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write k/v into the caches at meta.slot_mapping, then attend (causal, paged); on an
        int8 cache (`kv_scales`) quantized, and attending over the dequantized cache."""
        assert meta is self._meta, "forward() called with metadata that prepare() did not see"
        triton_kernels.write_kv_triton(k, v, key_cache, value_cache, meta.slot_mapping, kv_scales)
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        launches = ((self._decode_ids, 1), (self._prefill_ids, self._max_prefill_len))
        for seq_ids, max_query_len in launches:
            if seq_ids.numel() == 0:
                continue
            triton_kernels.paged_attention_triton(
                q,
                key_cache,
                value_cache,
                meta.block_tables,
                meta.seq_lens_tensor,
                self._query_start_loc,
                seq_ids,
                max_query_len,
                scale,
                out,
                kv_scales,
            )
        return out
