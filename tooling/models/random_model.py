"""Random-weight Llama models, written as standard Hugging Face folders, for tests and benchmarks.

Runs in the test process, in `pdserve make-model`, and in benchmark set-up; never in a worker's
serving path. No weights can be downloaded (DESIGN section 5), so tests and the demo build a
small model locally with a fixed seed; it loads exactly like a real checkpoint, in pdserve and in
HF transformers (`AutoTokenizer`, `LlamaForCausalLM`).

Folder contents: `config.json` (LlamaForCausalLM, float32), `model.safetensors` (HF parameter
names), `tokenizer.json` + `tokenizer_config.json` (a byte-level BPE trained on the fixed corpus
in `corpus.py`, so the vocabulary is identical on every machine; and `corpus.CHAT_TEMPLATE`),
`generation_config.json`.

A random model is a weak oracle unless it is made a strong one. Three choices make it strong:

- **Sharp attention.** Every projection is drawn with fan-in scale (std = 1/sqrt(fan_in)), so
  each sub-layer adds about as much to the residual stream as is already there and no layer is a
  no-op. q_proj and k_proj are then multiplied by `QK_GAIN` = 3 (about 13x HF's usual 0.02 for
  the tiny model), which makes the pre-softmax scores' std about QK_GAIN**2 = 9: attention is
  peaked, not near-uniform (tiny: mean max attention weight ~0.86), so an off-by-one RoPE
  position, a lost KV entry or a wrong GQA head mapping changes the greedy tokens of almost every
  prompt (tiny: shifting only the last token's position by one flips the next token on ~85% of
  random prompts, and a greedy continuation diverges soon after).
- **Special tokens never win the argmax.** The lm_head rows of BOS, EOS and PAD are zero, so
  their logit is exactly 0 while the largest of the other ~1000+ random logits is positive
  (the chance that all are negative is 2**-1000). Greedy comparisons are therefore never cut
  short or derailed by EOS handling; tests that need a stop use `stop_token_ids` or
  `max_tokens`. (Sampling at temperature > 0 can still pick them, rarely.)
- **Norm weights are not all ones.** RMSNorm weights are 1 +- 0.2 (uniform), so a norm that
  ignores its weight, or applies the wrong layer's, shows up in the logits.

Weights are drawn from uniform distributions (same std as the Gaussian they stand for) with a
private `torch.Generator`, never the global RNG: the same seed gives a byte-identical
`model.safetensors`, a different seed different bytes. Uniform sampling is integer arithmetic
plus one multiply-add, avoiding the CPU-feature-dependent vectorised log/cos of Gaussian
sampling, so the bytes should match across machines too. The lm_head is untied.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
from safetensors.torch import save_file

from tooling.models.corpus import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    train_tokenizer,
    write_tokenizer_files,
)

CheckpointDtype = Literal["float32", "bfloat16"]
_CHECKPOINT_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
QK_GAIN = 3.0
NORM_WEIGHT_SPREAD = 0.2


@dataclass(frozen=True)
class RandomModelPreset:
    """The shape of a random model; `corpus_words` sizes the tokenizer's training text."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    rope_theta: float
    corpus_words: int
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Total parameter count (embedding and untied lm_head included)."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        per_layer = h * q + 2 * h * kv + q * h + 3 * h * self.intermediate_size + 2 * h
        return self.num_hidden_layers * per_layer + 2 * self.vocab_size * h + h


PRESETS: dict[str, RandomModelPreset] = {
    # Fast tests: builds in well under a second, ~1.05M parameters.
    "tiny": RandomModelPreset(
        vocab_size=1024,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        corpus_words=20_000,
    ),
    # A draft for "tiny" (speculative decoding tests): its tokenizer (same vocab size and
    # corpus), a quarter of its layers' width and half its depth.
    "tiny-draft": RandomModelPreset(
        vocab_size=1024,
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        corpus_words=20_000,
    ),
    # Benchmarks: Llama-shaped, ~129M parameters (about 0.5 GB in float32).
    "small": RandomModelPreset(
        vocab_size=16384,
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        corpus_words=200_000,
    ),
    # A draft for "small" (speculative decoding benchmarks): its tokenizer, ~10M parameters.
    "small-draft": RandomModelPreset(
        vocab_size=16384,
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rope_theta=500000.0,
        corpus_words=200_000,
    ),
}


def _uniform(gen: torch.Generator, shape: tuple[int, ...], std: float) -> torch.Tensor:
    # U(-a, a) has std a/sqrt(3).
    a = std * math.sqrt(3.0)
    return (torch.rand(shape, generator=gen, dtype=torch.float32) * 2.0 - 1.0) * a


def random_weights(p: RandomModelPreset, vocab_size: int, seed: int) -> dict[str, torch.Tensor]:
    """All parameters under their HF names, drawn in a fixed order from one seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    h, d = p.hidden_size, p.head_dim
    q_dim, kv_dim = p.num_attention_heads * d, p.num_key_value_heads * d

    def norm_weight() -> torch.Tensor:
        return 1.0 + _uniform(gen, (h,), NORM_WEIGHT_SPREAD / math.sqrt(3.0))

    w: dict[str, torch.Tensor] = {"model.embed_tokens.weight": _uniform(gen, (vocab_size, h), 1.0)}
    for i in range(p.num_hidden_layers):
        pre = f"model.layers.{i}."
        w[pre + "self_attn.q_proj.weight"] = _uniform(gen, (q_dim, h), QK_GAIN / math.sqrt(h))
        w[pre + "self_attn.k_proj.weight"] = _uniform(gen, (kv_dim, h), QK_GAIN / math.sqrt(h))
        w[pre + "self_attn.v_proj.weight"] = _uniform(gen, (kv_dim, h), 1.0 / math.sqrt(h))
        w[pre + "self_attn.o_proj.weight"] = _uniform(gen, (h, q_dim), 1.0 / math.sqrt(q_dim))
        inter = p.intermediate_size
        w[pre + "mlp.gate_proj.weight"] = _uniform(gen, (inter, h), 1.0 / math.sqrt(h))
        w[pre + "mlp.up_proj.weight"] = _uniform(gen, (inter, h), 1.0 / math.sqrt(h))
        w[pre + "mlp.down_proj.weight"] = _uniform(gen, (h, inter), 1.0 / math.sqrt(inter))
        w[pre + "input_layernorm.weight"] = norm_weight()
        w[pre + "post_attention_layernorm.weight"] = norm_weight()
    w["model.norm.weight"] = norm_weight()
    lm_head = _uniform(gen, (vocab_size, h), 1.0 / math.sqrt(h))
    lm_head[[BOS_ID, EOS_ID, PAD_ID]] = 0.0  # special tokens' logit is exactly 0: never argmax
    w["lm_head.weight"] = lm_head
    return w


def hf_config(
    p: RandomModelPreset, vocab_size: int, dtype: CheckpointDtype = "float32"
) -> dict[str, object]:
    """The `config.json` contents (the standard HF Llama keys)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab_size,
        "hidden_size": p.hidden_size,
        "intermediate_size": p.intermediate_size,
        "num_hidden_layers": p.num_hidden_layers,
        "num_attention_heads": p.num_attention_heads,
        "num_key_value_heads": p.num_key_value_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": p.max_position_embeddings,
        "rms_norm_eps": p.rms_norm_eps,
        "rope_theta": p.rope_theta,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "initializer_range": 0.02,
        "pretraining_tp": 1,
        "use_cache": True,
        "torch_dtype": dtype,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def make_random_model(
    out_dir: str | Path,
    preset: Literal["tiny", "tiny-draft", "small", "small-draft"] = "tiny",
    seed: int = 0,
    dtype: CheckpointDtype = "float32",
) -> Path:
    """Write a random Llama model folder to `out_dir` (created if missing); return its path.

    Same `preset` and `seed` give byte-identical files. The model's vocab_size is the trained
    tokenizer's size, which the fixed corpus makes equal to the preset's. `dtype` "bfloat16"
    stores the same draws rounded to bfloat16 (as real checkpoints ship) and says so in
    `config.json`'s `torch_dtype`, so an engine with dtype "auto" runs it in bfloat16.
    """
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an integer >= 0, got {seed!r}")
    if dtype not in _CHECKPOINT_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_CHECKPOINT_DTYPES)}, got {dtype!r}")
    p = PRESETS[preset]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok = train_tokenizer(p.vocab_size, p.corpus_words)
    vocab_size = tok.get_vocab_size(with_added_tokens=True)
    write_tokenizer_files(out, tok, p.max_position_embeddings)
    _write_json(out / "config.json", hf_config(p, vocab_size, dtype))
    _write_json(
        out / "generation_config.json",
        {"bos_token_id": BOS_ID, "eos_token_id": EOS_ID, "pad_token_id": PAD_ID},
    )
    weights = out / "model.safetensors"
    tensors = {
        name: t.to(_CHECKPOINT_DTYPES[dtype]).contiguous()
        for name, t in random_weights(p, vocab_size, seed).items()
    }
    save_file(tensors, str(weights), {"format": "pt"})
    # safetensors writes through a private (0600) temp file: give the weights the permissions
    # of the files written beside them (0644 under the usual umask), so others can read them.
    weights.chmod((out / "config.json").stat().st_mode & 0o777)
    return out
