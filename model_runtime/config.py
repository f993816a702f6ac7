"""Model configuration read from a Hugging Face `config.json` (Llama, Mistral, Qwen2).

Torch-free: the router reads the served model's limits from it. Anything this runtime cannot run
faithfully fails here, at load, with a message naming the field and its value.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ACTIVATIONS = ("silu",)
SUPPORTED_DTYPES = ("float32", "bfloat16", "float16")
QuantType = Literal["Q8_0", "Q4_0", "Q4_1"]
QUANT_TYPES: tuple[QuantType, ...] = ("Q8_0", "Q4_0", "Q4_1")
QUANT_METHOD: Literal["ggml"] = "ggml"  # quantization_config.quant_method of a kept folder


class WeightQuantization(BaseModel):
    """`quantization_config` of a folder whose weights are kept quantized (`pdserve convert
    --weights keep`, `pdserve quantize`): which tensors are stored as ggml blocks, of which
    type. Each such tensor is a uint8 safetensors tensor [rows, row bytes] holding the rows'
    32-value blocks exactly as a GGUF file stores them (Q8_0: fp16 scale + 32 int8, 34 bytes;
    Q4_0: fp16 scale + 16 bytes of 4-bit codes, 18; Q4_1: fp16 scale + fp16 minimum + 16
    bytes, 20); every other tensor is an ordinary float tensor."""

    model_config = ConfigDict(frozen=True)

    quant_method: Literal["ggml"] = QUANT_METHOD
    tensor_types: dict[str, QuantType] = Field(
        description="HF tensor name -> ggml block type, for every tensor stored quantized."
    )

    def label(self) -> str:
        """The weights' types, most used first (by tensor count), e.g. 'Q4_1+Q8_0'."""
        counts: dict[str, int] = {}
        for t in self.tensor_types.values():
            counts[t] = counts.get(t, 0) + 1
        return "+".join(sorted(counts, key=lambda t: (-counts[t], t)))


class RopeScaling(BaseModel):
    """Llama-3 style RoPE frequency scaling (`rope_type = "llama3"`)."""

    model_config = ConfigDict(frozen=True)

    rope_type: Literal["llama3"] = "llama3"
    factor: float = Field(gt=0)
    low_freq_factor: float = Field(gt=0)
    high_freq_factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)


class ModelConfig(BaseModel):
    """The model hyper-parameters the runtime needs, validated and frozen."""

    model_config = ConfigDict(frozen=True)

    architecture: Literal["llama", "mistral", "qwen2"]
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    max_position_embeddings: int = Field(gt=0)
    rms_norm_eps: float = Field(gt=0)
    rope_theta: float = Field(gt=0)
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = Field(False, description="q/k/v projections carry a bias (Qwen2).")
    mlp_bias: bool = False
    torch_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    quantization: WeightQuantization | None = Field(
        None,
        description="Set when some weights are kept quantized (config.json's "
        "quantization_config); None for a float checkpoint.",
    )

    def weights_label(self, dtype: str | None = None) -> str:
        """What the served weights are: the quantized types (`WeightQuantization.label`) when
        any are kept quantized, else `dtype` (the engine's) or the checkpoint's dtype."""
        if self.quantization is not None:
            return self.quantization.label()
        return dtype or self.torch_dtype

    @model_validator(mode="after")
    def _check_heads(self) -> ModelConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        return self

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF config.json; raise ValueError naming unsupported fields."""
        archs = raw.get("architectures") or []
        if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json: architectures={archs!r} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        arch = SUPPORTED_ARCHITECTURES[archs[0]]
        act = raw.get("hidden_act", "silu")
        if act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"config.json: hidden_act={act!r} is not supported; use 'silu'")
        dtype = raw.get("torch_dtype") or raw.get("dtype") or "float32"
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"config.json: torch_dtype={dtype!r} is not supported; use one of "
                f"{list(SUPPORTED_DTYPES)}"
            )
        # transformers v5 writes `rope_parameters` (theta inside); v4 `rope_theta` + `rope_scaling`.
        rope_params = raw.get("rope_parameters")
        rope_theta = raw.get("rope_theta", 10000.0)
        rope_scaling = raw.get("rope_scaling")
        if isinstance(rope_params, dict):
            rope_theta = rope_params.get("rope_theta", rope_theta)
            rope_scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if rope_scaling is not None:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind == "default":
                rope_scaling = None
            elif kind != "llama3":
                raise ValueError(
                    f"config.json: rope_scaling.rope_type={kind!r} is not supported; "
                    "supported: 'llama3' or none"
                )
            else:
                rope_scaling = {k: v for k, v in rope_scaling.items() if k != "type"}
                rope_scaling["rope_type"] = "llama3"
        sliding = raw.get("sliding_window")
        use_sliding = raw.get("use_sliding_window", arch == "mistral")
        max_pos = int(raw.get("max_position_embeddings", 2048))
        if sliding is not None and use_sliding and int(sliding) < max_pos:
            raise ValueError(
                f"config.json: sliding_window={sliding} is smaller than "
                f"max_position_embeddings={max_pos}; sliding-window attention is not supported"
            )
        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        n_heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        head_dim = raw.get("head_dim") or hidden // n_heads
        try:
            return cls.model_validate(
                dict(
                    architecture=arch,
                    vocab_size=raw["vocab_size"],
                    hidden_size=hidden,
                    intermediate_size=raw["intermediate_size"],
                    num_hidden_layers=raw["num_hidden_layers"],
                    num_attention_heads=n_heads,
                    num_key_value_heads=raw.get("num_key_value_heads") or n_heads,
                    head_dim=head_dim,
                    max_position_embeddings=max_pos,
                    rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
                    rope_theta=rope_theta,
                    rope_scaling=rope_scaling,
                    tie_word_embeddings=raw.get("tie_word_embeddings", False),
                    attention_bias=raw.get("attention_bias", arch == "qwen2"),
                    mlp_bias=raw.get("mlp_bias", False),
                    torch_dtype=dtype,
                    bos_token_id=raw.get("bos_token_id"),
                    eos_token_ids=eos_ids,
                    pad_token_id=raw.get("pad_token_id"),
                    quantization=_quantization(raw.get("quantization_config")),
                )
            )
        except KeyError as exc:
            raise ValueError(f"config.json: required field {exc.args[0]!r} is missing") from exc

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> ModelConfig:
        """Read `<model_dir>/config.json` (plus eos ids from generation_config.json if present)."""
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"model folder {model_dir}: config.json not found")
        raw = json.loads(path.read_text())
        gen_path = Path(model_dir) / "generation_config.json"
        if gen_path.is_file() and raw.get("eos_token_id") is None:
            raw["eos_token_id"] = json.loads(gen_path.read_text()).get("eos_token_id")
        return cls.from_hf_dict(raw)


def _quantization(raw: Any) -> WeightQuantization | None:
    """config.json's `quantization_config`: None when absent; a ValueError naming the field for
    a method other than pdserve's kept ggml blocks (GPTQ, AWQ, bitsandbytes, ... are not run)."""
    if raw is None:
        return None
    method = raw.get("quant_method") if isinstance(raw, dict) else None
    if method != QUANT_METHOD:
        raise ValueError(
            f"config.json: quantization_config.quant_method={method!r} is not supported; "
            f"supported: {QUANT_METHOD!r} (folders written by `pdserve convert --weights keep` "
            "or `pdserve quantize`)"
        )
    return WeightQuantization.model_validate(raw)
