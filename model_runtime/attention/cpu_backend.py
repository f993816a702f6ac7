"""CPU attention backend: the torch reference with decode rows on a compiled kernel. Runs in
the engine thread of CPU workers.

Decode rows (one new token each: every row of a decode worker's step) go to
`model_runtime.kernels.decode_attention`, which reads each sequence's K/V blocks in place
(float32, bfloat16 or int8 with its scales);
prefill rows, and decode rows whose shapes the kernel does not take, use the torch reference
(`TorchAttentionBackend`) unchanged. Same contract as every backend (`attention.base`): K/V are
written first, so a layer of the cache is complete when `forward` returns.
"""

from __future__ import annotations

import torch

from model_runtime.attention.base import AttentionMetadata
from model_runtime.attention.torch_ref import KVScales, TorchAttentionBackend
from model_runtime.kernels import decode_attention


class CpuAttentionBackend(TorchAttentionBackend):
    """`AttentionBackend` for CPU caches: compiled decode attention, reference prefill."""

    name = "cpu"

    def prepare(self, meta: AttentionMetadata) -> None:
        super().prepare(meta)
        self._decode_lens64 = self._decode_lens.long()

    def _decode_attention(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        scale: float,
        kv_scales: KVScales | None,
    ) -> torch.Tensor:
        out = decode_attention.decode_attention(
            q, key_cache, value_cache, self._decode_tables, self._decode_lens64, scale, kv_scales
        )
        if out is None:  # a shape or dtype the kernel does not take
            return super()._decode_attention(q, key_cache, value_cache, scale, kv_scales)
        return out
