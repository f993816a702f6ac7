"""Paged KV cache storage for one worker process (owned by its engine thread).

Layout — one tensor for the whole cache, block-major within a layer. A full-precision cache
(`cache_dtype` "auto": the model's dtype)::

    kv: [num_layers, num_blocks, 2, block_size, num_kv_heads, head_dim]
                                 ^ 0 = key, 1 = value

An int8 cache (`cache_dtype` "int8", `model_runtime.kv_quant`) keeps one block of one layer as
one run of bytes, values and their per-token, per-head float16 scales together::

    kv: [num_layers, num_blocks, block_bytes] int8,  block_bytes = 2 * bs * H * (D + 2)

    byte 0                 K values  [bs, H, D] int8      (token t, head h: row (t * H + h))
    byte bs*H*D            V values  [bs, H, D] int8
    byte 2*bs*H*D          K scales  [bs, H]    float16   (one per token per head)
    byte 2*bs*H*D + 2*bs*H V scales  [bs, H]    float16

So the values keep the full-precision layout's row order (`layer` views them as the same
[num_blocks, bs, H, D] shapes), and anything that moves whole blocks — the KV transfer's
messages, shared memory, CUDA IPC, `copy_blocks` — moves the scales with the values, byte for
byte, without knowing the block's inside.

Block-major means one block's K and V of a layer sit side by side, so a run of consecutive
block ids is one contiguous region of a layer: the KV transfer sends it as one message without
copying it out first (`run_start` + `layer_slice`). The attention backends see a layer as two
strided views, key and value cache, each ``[num_blocks, block_size, num_kv_heads, head_dim]``
with a block stride of a whole block (`layer`), plus the two scale views on an int8 cache.

A token at position p of a sequence with block table `bt` lives in block `bt[p // block_size]`
at offset `p % block_size`; its *slot* is `block_id * block_size + offset`.

The KV transfer moves one layer of one request as a single contiguous tensor of whole blocks,
`[n_blocks, *kv.shape[2:]]` in the cache's storage dtype (`message_shape`; `layer_slice`,
`gather_layer` / `scatter_layer`).
Which blocks are free or cached is the `BlockPool`'s business, not this class's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple, get_args

import torch

from model_runtime.config import ModelConfig
from model_runtime.kv_quant import SCALE_BYTES, SCALE_DTYPE

KVCacheDtype = Literal["auto", "int8"]


def resolve_cache_dtype(cache_dtype: str, dtype: torch.dtype) -> str:
    """The name a cache of `cache_dtype` ("auto" | "int8") over a model in `dtype` stores its
    blocks in: "int8", or the model dtype's name ("bfloat16", "float32", ...)."""
    if cache_dtype not in get_args(KVCacheDtype):
        raise ValueError(
            f"kv_cache_dtype must be one of {list(get_args(KVCacheDtype))}, got {cache_dtype!r}"
        )
    return "int8" if cache_dtype == "int8" else str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """Everything two workers must agree on before KV can move between them.

    `dtype` is the model's K/V dtype, `cache_dtype` how the blocks store them (the same name,
    or "int8"): blocks move as stored, so both must match (`kvtransfer.types.check_layout`)."""

    model_name: str
    dtype: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    cache_dtype: str

    def mismatches(self, other: KVLayout) -> list[str]:
        """Human-readable differences, e.g. ``"block_size: 16 (here) != 32 (peer)"``."""
        out = []
        for name in self.__dataclass_fields__:
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                out.append(f"{name}: {mine!r} (here) != {theirs!r} (peer)")
        return out


class LayerKV(NamedTuple):
    """One layer of the cache as the attention backends see it (views, no copies).

    `key` / `value`: [num_blocks, block_size, num_kv_heads, head_dim] in the model dtype, or
    int8 on an int8 cache, whose `scales` are then the (key, value) float16 scales
    [num_blocks, block_size, num_kv_heads] (None on a full-precision cache)."""

    key: torch.Tensor
    value: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None


class KVCache:
    """The paged K/V tensors of one worker. Not thread-safe: one owner (the engine thread).

    `dtype` is the storage tensor's element type (what the KV transfer's messages hold: the
    model dtype, or int8), `model_dtype` the dtype of the K/V the model writes and reads,
    `cache_dtype` the name of how blocks are stored (`KVLayout.cache_dtype`)."""

    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        model_name: str = "",
        cache_dtype: str = "auto",
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
        self.model_dtype = dtype
        self.cache_dtype = resolve_cache_dtype(cache_dtype, dtype)
        self.quantized = self.cache_dtype == "int8"
        self.device = torch.device(device)
        if self.quantized:
            shape: tuple[int, ...] = (self.num_layers, num_blocks, self._block_bytes())
            self.kv = torch.zeros(shape, dtype=torch.int8, device=self.device)
        else:
            shape = (self.num_layers, num_blocks, 2, block_size, self.num_kv_heads, self.head_dim)
            self.kv = torch.zeros(shape, dtype=dtype, device=self.device)
        self.dtype = self.kv.dtype
        self.layout = KVLayout(
            model_name=model_name,
            dtype=str(dtype).removeprefix("torch."),
            block_size=block_size,
            num_layers=self.num_layers,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            cache_dtype=self.cache_dtype,
        )

    def _block_bytes(self) -> int:
        """Bytes of one int8 block of one layer: K and V values, then their scales."""
        tokens = self.block_size * self.num_kv_heads
        return 2 * tokens * (self.head_dim + SCALE_BYTES)

    @staticmethod
    def bytes_per_block(
        config: ModelConfig, block_size: int, dtype: torch.dtype, cache_dtype: str = "auto"
    ) -> int:
        """Memory one block takes across all layers (K and V, and an int8 cache's scales)."""
        rows = 2 * config.num_hidden_layers * block_size * config.num_key_value_heads
        if resolve_cache_dtype(cache_dtype, dtype) == "int8":
            return rows * (config.head_dim + SCALE_BYTES)
        return rows * config.head_dim * torch.tensor([], dtype=dtype).element_size()

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of one layer, as the KV transfer moves it."""
        return self.kv[0, 0].numel() * self.kv.element_size()

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

    def layer(self, layer_idx: int) -> LayerKV:
        """One layer's key and value views, each [num_blocks, block_size, H, D] (strided: the
        block stride skips the rest of each block), and on an int8 cache its scale views."""
        if not self.quantized:
            return LayerKV(self.kv[layer_idx, :, 0], self.kv[layer_idx, :, 1], None)
        blocks = self.kv[layer_idx]  # [num_blocks, block_bytes]
        n, bs, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        vals = bs * h * d
        scales = blocks[:, 2 * vals :].view(SCALE_DTYPE)  # [num_blocks, 2 * bs * h]
        return LayerKV(
            blocks[:, :vals].view(n, bs, h, d),
            blocks[:, vals : 2 * vals].view(n, bs, h, d),
            (scales[:, : bs * h].view(n, bs, h), scales[:, bs * h :].view(n, bs, h)),
        )

    def message_shape(self, num_blocks: int) -> tuple[int, ...]:
        """Shape of one layer of `num_blocks` blocks as the KV transfer moves it (whole blocks,
        in `dtype`)."""
        return (num_blocks, *self.kv.shape[2:])

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

    def layer_slices(self, first: int, count: int) -> tuple[torch.Tensor, ...]:
        """`layer_slice(l, first, count)` for every layer l, in one call (one view operation
        instead of one per layer: a KV transfer takes every layer's)."""
        return self.kv[:, first : first + count].unbind(0)

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
