"""Convert a Llama-family GGUF file (llama.cpp's format) into a Hugging Face model folder.

Runs in the CLI process (`pdserve convert`, `pdserve pull`) and in tests; never in a worker. The
folder it writes loads in pdserve's engine and in HF transformers alike:

    config.json              LlamaForCausalLM, from the `llama.*` metadata
    generation_config.json   BOS / EOS / PAD ids from `tokenizer.ggml.*_token_id`
    model.safetensors        HF parameter names, dequantized to --dtype (or, with
                             --weights keep, Q8_0 / Q4_0 / Q4_1 matrices as their blocks)
    tokenizer.json           byte-level BPE rebuilt from `tokenizer.ggml.*` with `tokenizers`
    tokenizer_config.json    special tokens, add_bos_token, and `tokenizer.chat_template`
    gguf_source.json         what was converted: file name, sha256, dtype (`pull` checks it)

Contract:

- Weights (`weights="dequantize"`, the default): every tensor is dequantized with the `gguf`
  package (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q2_K..Q6_K) to
  float32, then cast to the requested dtype once. `weights="keep"`: matrices in a type the
  engine's kernels run (Q8_0, Q4_0, Q4_1: `model_runtime.quant`) keep their bytes, each row's
  blocks as the file has them (uint8 [rows, row bytes]), listed in config.json's
  `quantization_config` (`model_runtime.config.WeightQuantization`); every other tensor is
  dequantized as above (norms, F16/BF16 matrices, and the K-quants and Q5 types, which the
  kernels do not run: a Q4_K_M file keeps nothing of its K-quant tensors). `dtype` is then the
  dtype of those float tensors and of the engine's activations and KV cache.
  Why a folder and not the GGUF file served as it is: the router, the tokenizer and every
  other reader keep reading one format (config.json + tokenizer.json, torch-free), q/k rows
  are unpermuted once here (block rows move whole), and `pdserve quantize` writes the same
  format from any HF folder.
- llama.cpp stores attn_q / attn_k rows permuted for its RoPE layout (convert_hf_to_gguf's
  `permute`); `unpermute_qk` undoes it. A file without `output.weight` has tied embeddings and
  the folder says `tie_word_embeddings: true` with no lm_head tensor.
- Everything is checked before anything is written: an architecture other than `llama`, a
  tensor type or tensor name this module does not know, RoPE scaling, or a tokenizer model or
  pre-tokenizer it cannot rebuild is a `GGUFConversionError` naming the value and what is
  supported. A corrupt file (truncated, flipped bytes, impossible counts, metadata numbers out
  of range, tensor shapes the metadata does not imply) is a `GGUFConversionError` too
  (`gguf_input`), and so are weights holding NaN or Inf unless `allow_non_finite`
  (`--allow-non-finite`). The folder is written into a temporary sibling and renamed into
  place at the end, so a failure (or Ctrl-C) never leaves a half-written `--out`; an `--out`
  that cannot be written (read-only, under a file) is named in a `GGUFConversionError`.

The layout choices follow llama.cpp's gguf-py (names, permutation) and transformers' own GGUF
loader (tokenizer reconstruction); the code is ours.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from tooling.models.gguf_input import (
    GGUFConversionError as GGUFConversionError,  # raised by everything here; re-exported
)
from tooling.models.gguf_input import (
    check_finite,
    check_shapes,
    count,
    open_gguf,
    positive_float,
    read_metadata,
    token_id,
)

Dtype = Literal["bfloat16", "float16", "float32"]
DTYPES: tuple[Dtype, ...] = ("bfloat16", "float16", "float32")
Weights = Literal["dequantize", "keep"]
WEIGHTS: tuple[Weights, ...] = ("dequantize", "keep")
# Tensor types `weights="keep"` keeps as they are (what model_runtime.quant's kernels run).
KEPT_TYPES = ("Q8_0", "Q4_0", "Q4_1")
SUPPORTED_ARCHITECTURES = ("llama",)
# Tensor types dequantized by the `gguf` package that this converter accepts.
SUPPORTED_TENSOR_TYPES = (
    "F32",
    "F16",
    "BF16",
    "Q4_0",
    "Q4_1",
    "Q5_0",
    "Q5_1",
    "Q8_0",
    "Q2_K",
    "Q3_K",
    "Q4_K",
    "Q5_K",
    "Q6_K",
)
CONVERTER_VERSION = 1

# GGUF per-layer tensor name -> HF name (after "model.layers.N.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}

# Pre-tokenizer split patterns, keyed by `tokenizer.ggml.pre` (llama.cpp's names; the patterns
# are llama.cpp's `regex_exprs` for that type).
_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# name -> (split digits one by one first, split regex)
_PRE_TOKENIZERS: dict[str, tuple[bool, str]] = {
    "default": (False, _GPT2_SPLIT),
    "gpt-2": (False, _GPT2_SPLIT),
    "smollm": (True, _GPT2_SPLIT),
    "llama-bpe": (False, _LLAMA3_SPLIT),
    "llama3": (False, _LLAMA3_SPLIT),
    "smaug-bpe": (False, _LLAMA3_SPLIT),
    "qwen2": (False, _QWEN2_SPLIT),
}
_CONTROL, _USER_DEFINED = 3, 4  # llama.cpp token types


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of the file, as llama.cpp names and stores it."""

    name: str
    type_name: str
    shape: tuple[int, ...]  # row-major (numpy) order: (rows, cols) for a matrix


def _require(meta: dict[str, Any], key: str) -> Any:
    if key not in meta:
        raise GGUFConversionError(f"GGUF metadata: required key {key!r} is missing")
    return meta[key]


def tensor_infos(reader: Any) -> list[GGUFTensorInfo]:
    """The file's tensors in file order (no data read)."""
    return [
        GGUFTensorInfo(
            t.name, t.tensor_type.name, tuple(int(n) for n in reversed(t.shape.tolist()))
        )
        for t in reader.tensors
    ]


def hf_name(gguf_name: str) -> str:
    """HF parameter name of a llama.cpp tensor name; GGUFConversionError if unknown."""
    if gguf_name in _TOP_NAMES:
        return _TOP_NAMES[gguf_name]
    parts = gguf_name.split(".")
    if (
        len(parts) == 4
        and parts[0] == "blk"
        and parts[1].isdigit()
        and parts[3] == "weight"
        and parts[2] in _LAYER_NAMES
    ):
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.weight"
    if gguf_name == "rope_freqs.weight":
        raise GGUFConversionError(
            "tensor 'rope_freqs.weight' (Llama-3.1 style RoPE frequency scaling) is not supported"
        )
    raise GGUFConversionError(f"tensor {gguf_name!r} is not a known llama tensor")


def hf_config(meta: dict[str, Any], tied: bool, dtype: Dtype) -> dict[str, Any]:
    """`config.json` for the file's `llama.*` metadata; raises on what we cannot represent."""
    arch = _require(meta, "general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise GGUFConversionError(
            f"GGUF general.architecture={arch!r} is not supported; supported: "
            f"{list(SUPPORTED_ARCHITECTURES)}"
        )
    p = f"{arch}."
    heads = count(meta, p + "attention.head_count")
    hidden = count(meta, p + "embedding_length")
    head_dim = count(meta, p + "attention.key_length", hidden // heads or None)
    rope_dim = count(meta, p + "rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise GGUFConversionError(
            f"GGUF {p}rope.dimension_count={rope_dim} differs from the head size {head_dim}; "
            "partial rotary embeddings are not supported"
        )
    scaling = meta.get(p + "rope.scaling.type", "none")
    if scaling != "none":
        raise GGUFConversionError(
            f"GGUF {p}rope.scaling.type={scaling!r} is not supported; supported: 'none'"
        )
    tokens = _require(meta, "tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFConversionError("GGUF tokenizer.ggml.tokens is not a list of tokens")
    vocab = count(meta, p + "vocab_size", len(tokens))

    def special(key: str) -> int | None:
        return token_id(meta, f"tokenizer.ggml.{key}", len(tokens))

    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": count(meta, p + "feed_forward_length"),
        "num_hidden_layers": count(meta, p + "block_count", least=0),
        "num_attention_heads": heads,
        "num_key_value_heads": count(meta, p + "attention.head_count_kv", heads),
        "head_dim": head_dim,
        "max_position_embeddings": count(meta, p + "context_length", 2048),
        "rms_norm_eps": positive_float(meta, p + "attention.layer_norm_rms_epsilon"),
        "rope_theta": positive_float(meta, p + "rope.freq_base", 10000.0),
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
        "bos_token_id": special("bos_token_id"),
        "eos_token_id": special("eos_token_id"),
        "pad_token_id": special("padding_token_id"),
    }


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation for a (n_head * head_dim, cols) matrix.

    convert_hf_to_gguf.py regroups each head's rows from HF's "first half, second half" RoPE
    order into interleaved pairs: w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2).
    Its inverse reshapes as (n_head, head_dim // 2, 2, cols) and swaps back.
    """
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFConversionError(f"q/k rows {rows} are not a multiple of 2 x {n_head} heads")
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def dequantize(reader_tensor: Any) -> np.ndarray:
    """A tensor's values as float32 in row-major (numpy) shape; raises on unsupported types."""
    import gguf

    name = reader_tensor.tensor_type.name
    if name not in SUPPORTED_TENSOR_TYPES:
        raise GGUFConversionError(
            f"tensor {reader_tensor.name!r} has type {name}, which is not supported; "
            f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    values = gguf.quants.dequantize(reader_tensor.data, reader_tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(reader_tensor.shape.tolist()))
    return np.array(values, dtype=np.float32).reshape(shape)  # a copy: the file is mapped read-only


def _check_tensors(infos: list[GGUFTensorInfo], config: dict[str, Any]) -> None:
    """Every tensor known and supported, of the shape the config implies; every tensor the
    model needs present."""
    for info in infos:
        if info.type_name not in SUPPORTED_TENSOR_TYPES:
            raise GGUFConversionError(
                f"tensor {info.name!r} has type {info.type_name}, which is not supported; "
                f"supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
            )
    check_shapes(((i.name, hf_name(i.name), i.shape) for i in infos), config)
    have = {i.name for i in infos}
    if config["num_hidden_layers"] * len(_LAYER_NAMES) > len(have):
        raise GGUFConversionError(
            f"GGUF file holds {len(have)} tensors, too few for "
            f"block_count={config['num_hidden_layers']} layers"
        )
    need = ["token_embd.weight", "output_norm.weight"] + [
        f"blk.{i}.{n}.weight" for i in range(config["num_hidden_layers"]) for n in _LAYER_NAMES
    ]
    missing = [n for n in need if n not in have]
    if missing:
        raise GGUFConversionError(f"GGUF file lacks tensors {missing[:3]} ({len(missing)} in all)")


def hf_tensors(
    reader: Any, config: dict[str, Any], allow_non_finite: bool = False, keep: bool = False
) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """(HF name -> array, HF name -> kept type): float32 arrays, or with `keep` uint8 blocks
    [rows, row bytes] for the matrices of a KEPT_TYPES type; q/k rows unpermuted either way
    (a block never spans two rows, so block rows move whole). Tensors are checked by
    `_check_tensors` first; one holding NaN or Inf (kept ones: their values) raises unless
    `allow_non_finite`."""
    out: dict[str, np.ndarray] = {}
    kept: dict[str, str] = {}
    for t in reader.tensors:
        w = dequantize(t)
        check_finite(t.name, w, allow_non_finite)
        kind = t.tensor_type.name
        if keep and kind in KEPT_TYPES and len(t.shape) == 2:
            w = np.array(t.data, dtype=np.uint8)  # a copy: the file is mapped read-only
            kept[hf_name(t.name)] = kind
        if ".attn_q." in t.name:
            w = unpermute_qk(w, config["num_attention_heads"])
        elif ".attn_k." in t.name:
            w = unpermute_qk(w, config["num_key_value_heads"])
        out[hf_name(t.name)] = w
    return out, kept


# --- tokenizer -----------------------------------------------------------------------------


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (byte-level BPE spells tokens with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs), strict=True))


def build_tokenizer(meta: dict[str, Any]) -> Any:
    """A `tokenizers.Tokenizer` equal to the one the file describes (byte-level BPE only).

    Tokens keep their ids; merges come from `tokenizer.ggml.merges`; tokens typed CONTROL (3)
    become special added tokens and USER_DEFINED (4) plain added tokens, so both are matched
    whole in text as llama.cpp does; the pre-tokenizer is chosen by `tokenizer.ggml.pre`.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = _require(meta, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise GGUFConversionError(
            f"GGUF tokenizer.ggml.model={kind!r} is not supported; supported: 'gpt2' "
            "(byte-level BPE)"
        )
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in _PRE_TOKENIZERS:
        raise GGUFConversionError(
            f"GGUF tokenizer.ggml.pre={pre!r} is not supported; supported: "
            f"{sorted(_PRE_TOKENIZERS)}"
        )
    tokens: list[str] = list(_require(meta, "tokenizer.ggml.tokens"))
    merges_raw: list[str] = list(_require(meta, "tokenizer.ggml.merges"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [1] * len(tokens))
    if len(types) != len(tokens):
        raise GGUFConversionError(
            f"GGUF tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens"
        )
    if not all(isinstance(t, str) for t in tokens) or not all(
        isinstance(m, str) for m in merges_raw
    ):
        raise GGUFConversionError("GGUF tokenizer.ggml.tokens / merges must be lists of strings")
    alphabet = _byte_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for i, text in enumerate(tokens):
        # A normal byte-level token is spelled in the byte alphabet already; respell any other.
        key = text if set(text) <= spelled or types[i] == _CONTROL else _respell(text, alphabet)
        vocab.setdefault(key, i)
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]
    if any(len(m) != 2 for m in merges):
        raise GGUFConversionError("GGUF tokenizer.ggml.merges holds an entry without a space")
    try:
        bpe = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)  # type: ignore[arg-type]
    except Exception as exc:  # `tokenizers` raises bare Exception for a bad vocab or merge
        raise GGUFConversionError(f"GGUF tokenizer does not build: {exc}") from exc
    tok = Tokenizer(bpe)
    digits, split = _PRE_TOKENIZERS[pre]
    add_prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", False))
    steps: list[Any] = [pre_tokenizers.Digits(individual_digits=True)] if digits else []
    if split == _GPT2_SPLIT:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=add_prefix, use_regex=False),
        ]
    tok.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    control = [t for t, ty in zip(tokens, types, strict=True) if ty == _CONTROL]
    user = [t for t, ty in zip(tokens, types, strict=True) if ty == _USER_DEFINED]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    if user:
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])
    return tok


def _respell(token: str, alphabet: dict[int, str]) -> str:
    return "".join(alphabet[b] for b in token.encode("utf-8"))


def tokenizer_config(meta: dict[str, Any], tokenizer_json: str) -> dict[str, Any]:
    """`tokenizer_config.json`: special-token strings, add_bos_token, the chat template."""
    tokens = meta["tokenizer.ggml.tokens"]
    out: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", True)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.get(f"{meta['general.architecture']}.context_length", 2048)),
    }
    for name, key in (
        ("bos_token", "bos_token_id"),
        ("eos_token", "eos_token_id"),
        ("unk_token", "unknown_token_id"),
        ("pad_token", "padding_token_id"),
    ):
        special = token_id(meta, f"tokenizer.ggml.{key}", len(tokens))
        if special is not None:
            out[name] = tokens[special]
    template = meta.get("tokenizer.chat_template")
    if template is not None:
        out["chat_template"] = template
    return out


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    """`generation_config.json`: the BOS / EOS / PAD ids the model was trained with."""
    out: dict[str, Any] = {}
    for name, key in (
        ("bos_token_id", "bos_token_id"),
        ("eos_token_id", "eos_token_id"),
        ("pad_token_id", "padding_token_id"),
    ):
        v = meta.get(f"tokenizer.ggml.{key}")
        if v is not None:
            out[name] = int(v)
    return out


# --- the conversion ------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n")


def _staging_dir(dst: Path) -> Path:
    """A fresh temporary sibling of `dst` to write the folder into; `dst` must not exist or be
    an empty folder. A place that cannot be written (read-only, under a file, no permission)
    is a `GGUFConversionError` naming it."""
    try:
        if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
            raise GGUFConversionError(
                f"{dst} already exists and is not empty; choose another --out"
            )
        dst.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    except OSError as exc:
        raise GGUFConversionError(
            f"--out {dst}: cannot write there: {exc.strerror or exc}"
        ) from exc


def convert_gguf(
    gguf_path: str | Path,
    out: str | Path,
    dtype: Dtype = "bfloat16",
    allow_non_finite: bool = False,
    weights: Weights = "dequantize",
) -> Path:
    """Convert `gguf_path` into the HF folder `out` (module docstring); returns `out`.

    1. Read metadata and tensor headers (`gguf_input`: a corrupt file is refused here); check
       architecture, tensor names, types and shapes, the tokenizer (all errors are raised
       here, before any file is written).
    2. Make the staging folder beside `out` (an `out` that cannot be written fails here).
    3. Dequantize every tensor (unpermuting q/k; NaN or Inf refused unless
       `allow_non_finite`) and cast to `dtype`; with `weights="keep"` the KEPT_TYPES matrices
       keep their blocks instead.
    4. Write the folder into the staging folder, then rename it to `out`.

    `out` must not exist or be an empty folder. Every failure is a `GGUFConversionError`.
    """
    import torch
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise GGUFConversionError(f"dtype {dtype!r} is not supported; supported: {list(DTYPES)}")
    if weights not in WEIGHTS:
        raise GGUFConversionError(
            f"weights {weights!r} is not supported; supported: {list(WEIGHTS)}"
        )
    src, dst = Path(gguf_path), Path(out)
    reader = open_gguf(src)
    meta = read_metadata(reader, src)
    infos = tensor_infos(reader)
    tied = not any(i.name == "output.weight" for i in infos)
    config = hf_config(meta, tied, dtype)
    _check_tensors(infos, config)
    tokenizer = build_tokenizer(meta)
    tokenizer_json = tokenizer.to_str()

    torch_dtype = getattr(torch, dtype)
    tmp = _staging_dir(dst)
    try:
        arrays, kept = hf_tensors(reader, config, allow_non_finite, keep=weights == "keep")
        tensors = {
            name: torch.from_numpy(w).contiguous()
            if name in kept
            else torch.from_numpy(w).to(torch_dtype).contiguous()
            for name, w in arrays.items()
        }
        if kept:
            config["quantization_config"] = {"quant_method": "ggml", "tensor_types": kept}
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        _write_json(tmp / "config.json", config)
        _write_json(tmp / "generation_config.json", generation_config(meta))
        (tmp / "tokenizer.json").write_text(tokenizer_json)
        _write_json(tmp / "tokenizer_config.json", tokenizer_config(meta, tokenizer_json))
        _write_json(
            tmp / "gguf_source.json",
            {
                "file": src.name,
                "sha256": file_sha256(src),
                "dtype": dtype,
                "weights": weights,
                "converter_version": CONVERTER_VERSION,
            },
        )
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        try:
            os.rename(tmp, dst)
        except OSError as exc:  # another conversion filled `dst` meanwhile
            raise GGUFConversionError(f"{dst} was written by someone else meanwhile") from exc
    except OSError as exc:  # a full disk, a folder made read-only meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
        raise GGUFConversionError(f"--out {dst}: writing failed: {exc.strerror or exc}") from exc
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
