"""Load HF-format safetensors weights (single file or sharded) into `LlamaModel`.

Runs in worker processes. Every expected tensor must be present with the expected shape; an
unknown tensor, a missing one, a wrong shape or an unsupported dtype is a ValueError naming the
tensor, what was expected and what was found. HF's separate q/k/v and gate/up projections are
fused here into the model's `qkv_proj` / `gate_up_proj`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from model_runtime.config import ModelConfig
from model_runtime.model import DecoderLayer, LlamaModel, rope_tables

_SUPPORTED_TENSOR_DTYPES = {torch.float32, torch.bfloat16, torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model folder (index-driven when sharded)."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    raise ValueError(
        f"model folder {model_dir}: no model.safetensors or model.safetensors.index.json"
    )


def expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape, for every tensor the model needs."""
    h, d = config.hidden_size, config.head_dim
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (config.intermediate_size, h),
            p + "mlp.up_proj.weight": (config.intermediate_size, h),
            p + "mlp.down_proj.weight": (h, config.intermediate_size),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if config.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q,),
                p + "self_attn.k_proj.bias": (kv,),
                p + "self_attn.v_proj.bias": (kv,),
            }
    return shapes


def read_checkpoint(model_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Read and check every tensor; returns HF name -> tensor (checkpoint dtype)."""
    shapes = expected_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for path in weight_files(model_dir):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
                if name.endswith(_IGNORED_SUFFIXES):
                    continue
                if name == "lm_head.weight" and config.tie_word_embeddings:
                    continue
                if name not in shapes:
                    raise ValueError(
                        f"{path.name}: unexpected tensor {name!r} for {config.architecture}"
                    )
                t = f.get_tensor(name)
                if tuple(t.shape) != shapes[name]:
                    raise ValueError(
                        f"{path.name}: tensor {name!r} has shape {tuple(t.shape)}, "
                        f"expected {shapes[name]}"
                    )
                if t.dtype not in _SUPPORTED_TENSOR_DTYPES:
                    raise ValueError(
                        f"{path.name}: tensor {name!r} has dtype {t.dtype}; "
                        "supported: float32, bfloat16, float16"
                    )
                tensors[name] = t
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ValueError(f"model folder {model_dir}: missing tensors {missing[:3]}{more}")
    return tensors


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
) -> LlamaModel:
    """Build a `LlamaModel` on `device` in `dtype` with the folder's weights, in eval mode."""
    model_dir = Path(model_dir)
    w = read_checkpoint(model_dir, config)
    with torch.device("meta"):
        model = LlamaModel(config)
    model = model.to_empty(device=device)
    # Buffers (RoPE tables) were created on meta: rebuild them for real.
    cos, sin = rope_tables(config)
    model.cos_cache, model.sin_cache = cos.to(device), sin.to(device)

    def put(param: torch.nn.Parameter, value: torch.Tensor) -> None:
        param.data = value.to(device=device, dtype=dtype).contiguous()

    put(model.embed_tokens, w["model.embed_tokens.weight"])
    put(model.norm.weight, w["model.norm.weight"])
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens  # one tensor, two uses
    else:
        put(model.lm_head.weight, w["lm_head.weight"])
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)  # ModuleList yields plain `nn.Module`s
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        put(
            attn.qkv_proj.weight,
            torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
        )
        if attn.qkv_proj.bias is not None:
            put(attn.qkv_proj.bias, torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        put(attn.o_proj.weight, w[p + "self_attn.o_proj.weight"])
        put(
            mlp.gate_up_proj.weight,
            torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]),
        )
        put(mlp.down_proj.weight, w[p + "mlp.down_proj.weight"])
        put(layer.input_layernorm.weight, w[p + "input_layernorm.weight"])
        put(layer.post_attention_layernorm.weight, w[p + "post_attention_layernorm.weight"])
    model.requires_grad_(False)
    return model.eval()
