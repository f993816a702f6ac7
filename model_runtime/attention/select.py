"""Choose an attention backend by name: the one factory over the `AttentionBackend` seam.

Kept apart from `base` so the interface module imports no implementation (no import loop).
Runs in every worker process, once, when the model runner is built.
"""

from __future__ import annotations

import torch

from model_runtime.attention.base import AttentionBackend


def get_backend(name: str, device: torch.device) -> AttentionBackend:
    """`torch`, `cpu`, `triton` or `auto`: Triton on CUDA when importable; on CPU the `cpu`
    backend (compiled decode attention) where its kernel builds, else torch."""
    from model_runtime.attention.torch_ref import TorchAttentionBackend

    if name not in ("auto", "torch", "cpu", "triton"):
        raise ValueError(
            f"attention backend must be 'auto', 'torch', 'cpu' or 'triton', got {name!r}"
        )
    if name == "torch":
        return TorchAttentionBackend()
    if name == "cpu" or (name == "auto" and device.type == "cpu"):
        from model_runtime.attention.cpu_backend import CpuAttentionBackend
        from model_runtime.kernels import decode_attention

        if device.type == "cpu" and decode_attention.load() is not None:
            return CpuAttentionBackend()
        if name == "cpu":
            why = decode_attention.unavailable_reason() or f"device is {device}, not cpu"
            raise ValueError(f"attention backend 'cpu' unavailable: {why}")
        return TorchAttentionBackend()
    if name == "auto" and device.type != "cuda":
        return TorchAttentionBackend()
    try:
        from model_runtime.attention.triton_backend import TritonAttentionBackend
    except ImportError as exc:
        if name == "triton":
            raise ValueError(f"attention backend 'triton' unavailable: {exc}") from exc
        return TorchAttentionBackend()
    return TritonAttentionBackend()
