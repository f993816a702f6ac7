"""Small `ModelConfig`s for tests that need shapes, not weights (KV caches, layouts)."""

from __future__ import annotations

from typing import Any

from model_runtime.config import ModelConfig


def tiny_model_config(**overrides: Any) -> ModelConfig:
    """A 2-layer GQA Llama config (4 heads, 2 KV heads, head_dim 8); `overrides` replace any
    field."""
    fields: dict[str, Any] = {
        "architecture": "llama",
        "vocab_size": 32,
        "hidden_size": 32,
        "intermediate_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 1e4,
    }
    fields.update(overrides)
    return ModelConfig(**fields)
