"""Write an HF Llama folder as a GGUF file: the inverse of `gguf_convert`, for tests and for
serving the same weights with llama.cpp (benchmarks/llamacpp_server.py).

Runs in the CLI / test process. Follows llama.cpp's convert_hf_to_gguf.py for Llama: tensor
names, the q/k row permutation, `llama.*` metadata, and a byte-level BPE tokenizer stored as
`tokenizer.ggml.tokens` / `merges` / `token_type` (added special tokens typed CONTROL) with the
chat template and BOS / EOS ids. Matrices are stored in the requested tensor type (quantized
with `gguf.quants.quantize`: F32, F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1); 1-D tensors (norms)
always in F32, as llama.cpp does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

# HF name -> GGUF name, inverse of gguf_convert's tables.
_TOP = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
WRITABLE_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def gguf_name(hf: str) -> str:
    """GGUF tensor name of an HF Llama parameter name; ValueError if it has none."""
    if hf in _TOP:
        return _TOP[hf]
    parts = hf.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[-1] == "weight":
        key = ".".join(parts[3:-1])
        if key in _LAYER:
            return f"blk.{parts[2]}.{_LAYER[key]}.weight"
    raise ValueError(f"tensor {hf!r} has no GGUF llama name")


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (convert_hf_to_gguf.py `permute`); `unpermute_qk` undoes it."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _pre_tokenizer_name(tok: dict[str, Any]) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json's pre-tokenizer (two shapes known)."""
    pre = tok.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "default"
    steps = pre.get("pretokenizers") or []
    if (
        pre.get("type") == "Sequence"
        and [s.get("type") for s in steps] == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"
    raise ValueError(f"tokenizer.json pre_tokenizer {pre!r} has no known GGUF pre-tokenizer name")


def add_tokenizer(writer: Any, model_dir: Path, config: dict[str, Any]) -> None:
    """Add the folder's byte-level BPE tokenizer, BOS / EOS / PAD ids and chat template."""
    import gguf

    tok = json.loads((model_dir / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"tokenizer.json model type {model.get('type')!r}: only BPE is written")
    vocab: dict[str, int] = dict(model["vocab"])
    special = {a["content"]: a["id"] for a in tok.get("added_tokens", [])}
    vocab.update(special)
    n = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(n)]
    types = [gguf.TokenType.UNUSED] * n
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = gguf.TokenType.CONTROL if text in special else gguf.TokenType.NORMAL
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(_pre_tokenizer_name(tok))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    tok_cfg_path = model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    gen_path = model_dir / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    ids = {**{k: v for k, v in config.items() if k.endswith("_token_id")}, **gen}
    if isinstance(ids.get("bos_token_id"), int):
        writer.add_bos_token_id(ids["bos_token_id"])
    eos = ids.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if isinstance(eos, int):
        writer.add_eos_token_id(eos)
    if isinstance(ids.get("pad_token_id"), int):
        writer.add_pad_token_id(ids["pad_token_id"])
    writer.add_add_bos_token(bool(tok_cfg.get("add_bos_token", True)))
    if isinstance(tok_cfg.get("chat_template"), str):
        writer.add_chat_template(tok_cfg["chat_template"])


def hf_to_gguf(model_dir: str | Path, out: str | Path, tensor_type: str = "F16") -> Path:
    """Write the Llama folder `model_dir` as the GGUF file `out` with matrices in `tensor_type`.

    Raises ValueError for a type outside WRITABLE_TYPES, a non-Llama folder or an unknown tensor.
    """
    import gguf
    import torch
    from safetensors import safe_open

    if tensor_type not in WRITABLE_TYPES:
        raise ValueError(f"tensor type {tensor_type!r}: writable are {list(WRITABLE_TYPES)}")
    qtype = gguf.GGMLQuantizationType[tensor_type]
    src = Path(model_dir)
    config = json.loads((src / "config.json").read_text())
    if config.get("architectures") != ["LlamaForCausalLM"]:
        raise ValueError(f"{src}: architectures {config.get('architectures')}; only Llama")
    heads = int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or config["hidden_size"] // heads)
    writer = gguf.GGUFWriter(str(out), arch="llama")
    writer.add_name(src.name)
    writer.add_block_count(int(config["num_hidden_layers"]))
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(int(config["hidden_size"]))
    writer.add_feed_forward_length(int(config["intermediate_size"]))
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    writer.add_vocab_size(int(config["vocab_size"]))
    writer.add_file_type(
        {"F32": 0, "F16": 1, "BF16": 32, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9}[
            tensor_type
        ]
    )
    add_tokenizer(writer, src, config)
    with safe_open(str(src / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 - safe_open is not a Mapping
            if name.endswith("rotary_emb.inv_freq"):
                continue
            w = f.get_tensor(name).to(torch.float32).numpy()
            if ".q_proj." in name:
                w = permute_qk(w, heads)
            elif ".k_proj." in name:
                w = permute_qk(w, kv_heads)
            gname = gguf_name(name)
            if w.ndim == 1 or qtype == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(gname, np.ascontiguousarray(w, dtype=np.float32))
            elif qtype == gguf.GGMLQuantizationType.F16:
                writer.add_tensor(gname, w.astype(np.float16))
            else:
                writer.add_tensor(gname, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return Path(out)
