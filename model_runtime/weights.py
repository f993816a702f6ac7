"""Load HF-format safetensors weights (single file or sharded) into `LlamaModel`.

Runs in worker processes. Every expected tensor must be present with the expected shape; an
unknown tensor, a missing one, a wrong shape or an unsupported dtype is a ValueError naming the
tensor, what was expected and what was found. HF's separate q/k/v and gate/up projections are
fused here into the model's `qkv_proj` / `gate_up_proj`.

A folder with a `quantization_config` (`config.WeightQuantization`) stores some matrices as
ggml blocks (uint8 [rows, row bytes]); those stay quantized (`quant.pack_blocks`, `Linear.
set_quant`, `LlamaModel.set_quant_embedding`): the model never holds a float copy of them. A
fused projection whose parts are of different types is dequantized into an ordinary float
weight instead (said in the log).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch
from safetensors import safe_open

from model_runtime import quant
from model_runtime.config import ModelConfig, QuantType
from model_runtime.linear import Linear
from model_runtime.model import DecoderLayer, LlamaModel, rope_tables

_SUPPORTED_TENSOR_DTYPES = {torch.float32, torch.bfloat16, torch.float16}
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
log = logging.getLogger(__name__)


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


def stored_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape as stored: `expected_shapes`, with [rows, row bytes] for the
    tensors the folder keeps quantized. A quantized name the model does not have, or a type
    whose blocks do not divide the row, is a ValueError naming it."""
    shapes = expected_shapes(config)
    types = config.quantization.tensor_types if config.quantization is not None else {}
    for name, qtype in types.items():
        if name not in shapes or len(shapes[name]) != 2:
            raise ValueError(f"quantization_config names {name!r}, which is not a matrix")
        rows, cols = shapes[name]
        shapes[name] = (rows, quant.row_bytes(qtype, cols))
    return shapes


def read_checkpoint(model_dir: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Read and check every tensor; returns HF name -> tensor (checkpoint dtype; uint8 blocks
    for the quantized ones)."""
    shapes = stored_shapes(config)
    types = config.quantization.tensor_types if config.quantization is not None else {}
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
                if name in types:
                    if t.dtype != torch.uint8:
                        raise ValueError(
                            f"{path.name}: tensor {name!r} is {types[name]} blocks, stored as "
                            f"{t.dtype}; expected uint8"
                        )
                elif t.dtype not in _SUPPORTED_TENSOR_DTYPES:
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
    """Build a `LlamaModel` on `device` in `dtype` with the folder's weights, in eval mode.
    Quantized weights (module doc) stay quantized; such a folder loads on the CPU only (a
    ValueError naming the device otherwise)."""
    model_dir = Path(model_dir)
    if config.quantization is not None and torch.device(device).type != "cpu":
        raise ValueError(
            f"model folder {model_dir}: weights kept quantized "
            f"({config.quantization.label()}) are served on CPU only, got device {device!r}; "
            "convert the GGUF with --weights dequantize for a GPU"
        )
    w = read_checkpoint(model_dir, config)
    types = dict(config.quantization.tensor_types) if config.quantization is not None else {}
    with torch.device("meta"):
        model = LlamaModel(config)
    # Linears whose weights stay quantized get no float storage (to_empty would allocate it).
    for linear, parts in _linear_parts(model, config):
        if _one_type(parts, types) is not None:
            linear.weight = torch.nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    model = model.to_empty(device=device)
    # Buffers (RoPE tables) were created on meta: rebuild them for real.
    cos, sin = rope_tables(config)
    model.cos_cache, model.sin_cache = cos.to(device), sin.to(device)

    def put(param: torch.nn.Parameter, value: torch.Tensor) -> None:
        param.data = value.to(device=device, dtype=dtype).contiguous()

    embed = "model.embed_tokens.weight"
    if embed in types:
        model.set_quant_embedding(
            quant.pack_blocks(w.pop(embed), types[embed], config.hidden_size), dtype
        )
    else:
        put(model.embed_tokens, w[embed])
    put(model.norm.weight, w["model.norm.weight"])
    for linear, parts in _linear_parts(model, config):
        qtype = _one_type(parts, types)
        if linear is model.lm_head and config.tie_word_embeddings:
            if model.embed_quant is not None:
                linear.set_quant(model.embed_quant)  # one packed tensor, two uses
            else:
                model.lm_head.weight = model.embed_tokens  # one tensor, two uses
        elif qtype is not None:
            raw = torch.cat([w.pop(p) for p in parts])  # the blocks go as they are packed
            linear.set_quant(quant.pack_blocks(raw, qtype, linear.in_features))
        else:
            if any(p in types for p in parts):
                log.info("%s: parts of different types %s; dequantized", parts[0], parts)
            put(linear.weight, torch.cat([_float(w[p], types.get(p)) for p in parts]))
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)  # ModuleList yields plain `nn.Module`s
        p = f"model.layers.{i}."
        attn = layer.self_attn
        if attn.qkv_proj.bias is not None:
            put(attn.qkv_proj.bias, torch.cat([w[p + f"self_attn.{n}_proj.bias"] for n in "qkv"]))
        put(layer.input_layernorm.weight, w[p + "input_layernorm.weight"])
        put(layer.post_attention_layernorm.weight, w[p + "post_attention_layernorm.weight"])
    model.requires_grad_(False)
    return model.eval()


def _linear_parts(model: LlamaModel, config: ModelConfig) -> list[tuple[Linear, list[str]]]:
    """Each Linear of the model with the checkpoint tensors it is made of, in order (the LM
    head's is the embedding's when tied)."""
    head = "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"
    out: list[tuple[Linear, list[str]]] = [(model.lm_head, [head])]
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{i}."
        attn, mlp = layer.self_attn, layer.mlp
        out += [
            (attn.qkv_proj, [p + f"self_attn.{n}_proj.weight" for n in "qkv"]),
            (attn.o_proj, [p + "self_attn.o_proj.weight"]),
            (mlp.gate_up_proj, [p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
            (mlp.down_proj, [p + "mlp.down_proj.weight"]),
        ]
    return out


def _one_type(parts: list[str], types: dict[str, QuantType]) -> QuantType | None:
    """The quantized type all `parts` share, or None (some float, or types differ)."""
    kinds = {types.get(p) for p in parts}
    return kinds.pop() if len(kinds) == 1 else None


def _float(t: torch.Tensor, qtype: QuantType | None) -> torch.Tensor:
    """A stored tensor as float: dequantized when it holds blocks."""
    return (
        t
        if qtype is None
        else quant.dequantize_blocks(t, qtype, t.shape[1] // quant.BLOCK_BYTES[qtype] * quant.BLOCK)
    )
