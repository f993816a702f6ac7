"""How a receiving thread writes a layer into the destination blocks (decode workers).

`write_layer` does what `KVCache.scatter_layer` does, but on CPU through a numpy fancy-index
assignment over a same-width integer view of the cache: single-threaded, GIL-free and
bit-exact for every dtype. Torch's 2-thread ``index_copy_`` stalls on the second OpenMP thread
on a busy 2-core host (~5 ms per 4 MB against ~0.1 ms here), and a helper thread should not fan
out an OpenMP team that competes with the engine's own anyway. Other devices use
`KVCache.scatter_layer`. (The sender keeps `KVCache.gather_layer`: it runs on the engine thread,
and its freshly allocated result from torch's allocator is cheaper to send than a numpy one.)
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt
import torch

from model_runtime.kv_cache import KVCache

_SAME_WIDTH_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _as_int(t: torch.Tensor) -> npt.NDArray[np.generic]:
    """A numpy view of `t`'s bytes as integers of the same width (no copy)."""
    return t.view(_SAME_WIDTH_INT[t.element_size()]).numpy()


def write_layer(cache: KVCache, layer: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
    """Write a ``[2, len(block_ids), bs, H, D]`` layer into `block_ids` of `layer`."""
    if cache.device.type != "cpu":
        cache.scatter_layer(layer, block_ids, data)
        return
    expected = (2, len(block_ids), cache.block_size, cache.num_kv_heads, cache.head_dim)
    if tuple(data.shape) != expected or data.dtype != cache.dtype:
        raise ValueError(
            f"write_layer: got {tuple(data.shape)} {data.dtype}, want {expected} {cache.dtype}"
        )
    dst = _as_int(cache.kv[layer])
    dst[:, np.asarray(block_ids, dtype=np.int64)] = _as_int(data.contiguous())
