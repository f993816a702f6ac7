"""Choose an attention backend by name: the one factory over the `AttentionBackend` seam.

Kept apart from `base` so the interface module imports no implementation (no import loop).
Runs in every worker process, once, when the model runner is built.
"""

from __future__ import annotations

import torch

from model_runtime.attention.base import AttentionBackend


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`torch`, `triton` or `auto` (Triton on CUDA when importable, else torch)."""
    from model_runtime.attention.torch_ref import TorchAttentionBackend

    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention backend must be 'auto', 'torch' or 'triton', got {name!r}")
    if name == "torch" or (name == "auto" and device.type != "cuda"):
        return TorchAttentionBackend()
    try:
        from model_runtime.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        if name == "triton":
            raise ValueError(f"attention backend 'triton' unavailable: {exc}") from exc
        return TorchAttentionBackend()
    return TritonAttentionBackend()
