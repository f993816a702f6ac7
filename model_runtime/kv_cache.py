"""Paged KV cache storage for one worker process (owned by its engine thread).

Layout — one tensor for the whole cache, block-major within a layer::

    kv: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
                                 ^ 0 = key, 1 = value

Block-major means one block's K and V of a layer sit side by side, so a run of consecutive
block ids is one contiguous region of a layer: the KV transfer sends it as one message without
copying it out first (`run_start` + `layer_slice`). The attention backends see a layer as two
strided views, key and value cache, each ``[num_blocks, block_size, num_kv_heads, head_dim]``
with a block stride of ``2 * block_size * num_kv_heads * head_dim`` (`layer`).

A token at position p of a sequence with block table `bt` lives in block `bt[p // block_size]`
at offset `p % block_size`; its *slot* is `block_id * block_size + offset`.

The KV transfer moves one layer of one request as a single contiguous tensor
`[n_blocks, 2, block_size, num_kv_heads, head_dim]` (`message_shape`; `layer_slice`,
`gather_layer` / `scatter_layer`).
Which blocks are free or cached is the `BlockPool`'s business, not this class's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from model_runtime.config import ModelConfig


@dataclass(frozen=True)
class KVLayout:
    """Everything two workers must agree on before KV can move between them."""

    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int

    def mismatches(self, other: KVLayout) -> list[str]:
        """Human-readable differences, e.g. ``"block_size: 16 (here) != 32 (peer)"``."""
        out = []
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: {mine!r} (here) != {theirs!r} (peer)")
        return out


class KVCache:
    """The paged K/V tensors of one worker. Not thread-safe: one owner (the engine thread)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        model_name: str = "",
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(
                f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        self.kv = torch.zeros(
            (self.num_layers, num_blocks, 2, block_size, self.num_kv_heads, self.head_dim),
            dtype=dtype,
            device=self.device,
        )
        self.layout = KVLayout(
            model_name=model_name,
            dtype=str(dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Memory one block takes across all layers (K and V)."""
        elem = torch.tensor([], dtype=dtype).element_size()
        return (
            2
            * config.num_hidden_layers
            * block_size
            * config.num_key_value_heads
            * config.head_dim
            * elem
        )

    def adopt_kv(self, kv: torch.Tensor) -> None:
        """Move the cache into `kv` (same shape, dtype and device; e.g. shared memory), copying
        what it holds. Only before a step runs: views taken of the old tensor go stale."""
        if kv.shape != self.kv.shape or kv.dtype != self.kv.dtype or kv.device != self.kv.device:
            raise ValueError(
                f"adopt_kv: got {tuple(kv.shape)} {kv.dtype} on {kv.device}, want "
                f"{tuple(self.kv.shape)} {self.kv.dtype} on {self.kv.device}"
            )
        kv.copy_(self.kv)
        self.kv = kv

    def layer(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(key_cache, value_cache) views of one layer, each [num_blocks, block_size, H, D]
        (strided: the block stride skips the other half of each block)."""
        return self.kv[layer_idx, :, 0], self.kv[layer_idx, :, 1]

    def message_shape(self, num_blocks: int) -> tuple[int, int, int, int, int]:
        """Shape of one layer of `num_blocks` blocks as the KV transfer moves it."""
        return (num_blocks, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @staticmethod
    def run_start(block_ids: Sequence[int]) -> int | None:
        """The first id when `block_ids` are consecutive ascending ids, else None."""
        if not block_ids:
            return None
        first = block_ids[0]
        if any(b != first + i for i, b in enumerate(block_ids)):
            return None
        return first

    def layer_slice(self, layer_idx: int, first: int, count: int) -> torch.Tensor:
        """A view (no copy) of blocks first .. first+count-1 of one layer, contiguous and
        shaped `message_shape(count)`."""
        return self.kv[layer_idx, first : first + count]

    def gather_layer(
        self, layer_idx: int, block_ids: Sequence[int], out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Copy one layer's blocks out into `out` (contiguous, `message_shape(len(block_ids))`)
        or a new tensor; returns it."""
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        if out is None:
            return self.kv[layer_idx].index_select(0, idx)
        return torch.index_select(self.kv[layer_idx], 0, idx, out=out)

    def scatter_layer(self, layer_idx: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Write a `gather_layer`-shaped tensor into this cache's `block_ids` of one layer."""
        expected = self.message_shape(len(block_ids))
        if tuple(data.shape) != expected:
            raise ValueError(f"scatter_layer: got shape {tuple(data.shape)}, want {expected}")
        idx = torch.as_tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.kv[layer_idx].index_copy_(0, idx, data.to(self.kv.device, self.kv.dtype))

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        """Copy whole blocks (all layers) src[i] -> dst[i] inside this cache."""
        s = torch.as_tensor(list(src), dtype=torch.long, device=self.device)
        d = torch.as_tensor(list(dst), dtype=torch.long, device=self.device)
        self.kv.index_copy_(1, d, self.kv.index_select(1, s))
