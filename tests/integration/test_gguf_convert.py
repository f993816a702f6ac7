"""`pdserve convert` (tooling.models.gguf_convert) on small GGUF files written here with the
`gguf` package: one file per tensor type, round-tripped back to an HF folder.

Oracles: quantization is row-wise, so llama.cpp's q/k row permutation commutes with it and the
converted weights must equal `dequantize(quantize(w))` of the original HF tensors exactly (a
wrong or missing unpermute breaks equality). For the K-quants, which the `gguf` package can only
decode, random blocks are written raw and the converted weights must equal HF transformers'
own GGUF loader (an independent dequantizer and unpermute). The tokenizer must encode like the
original `tokenizer.json`; errors must name what is unsupported and leave nothing behind.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from deploy.cli import main
from model_runtime.config import ModelConfig
from model_runtime.tokenizer import Tokenizer
from tooling.models.gguf_convert import GGUFConversionError, convert_gguf
from tooling.models.gguf_write import WRITABLE_TYPES, add_tokenizer, hf_to_gguf

TEXTS = [
    "The lighthouse on the northern cape was built in 1871.",
    "Zoë paid €2.50 for a café crème — naïve, perhaps.",
    "  leading and trailing spaces  <s> and </s> kept whole",
]
# Largest |converted - original| for the tiny model's weights, per type (measured: F16 5e-4,
# BF16 4e-3, Q8_0 7e-3, Q5_1 0.06, Q5_0 0.11, Q4_1 0.12, Q4_0 0.22); a bound catches a type
# decoded as the wrong one, the exact comparison below catches everything else.
ERROR_BOUND = {
    "F32": 0.0,
    "F16": 1e-3,
    "BF16": 1e-2,
    "Q8_0": 2e-2,
    "Q5_1": 0.15,
    "Q5_0": 0.25,
    "Q4_1": 0.25,
    "Q4_0": 0.5,
}


def _expected(w: torch.Tensor, tensor_type: str) -> np.ndarray:
    """What a converter must produce for an original tensor stored as `tensor_type`."""
    a = w.to(torch.float32).numpy()
    if a.ndim == 1 or tensor_type == "F32":
        return a
    if tensor_type == "F16":
        return a.astype(np.float16).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    return np.asarray(gguf.quants.dequantize(gguf.quants.quantize(a, qtype), qtype), np.float32)


@pytest.mark.parametrize("tensor_type", WRITABLE_TYPES)
def test_round_trip_per_tensor_type(tiny_model_dir: Path, tmp_path: Path, tensor_type: str) -> None:
    src = hf_to_gguf(tiny_model_dir, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    out = tmp_path / "hf"
    assert main(["convert", "--gguf", str(src), "--out", str(out), "--dtype", "float32"]) == 0
    original = load_file(str(tiny_model_dir / "model.safetensors"))
    converted = load_file(str(out / "model.safetensors"))
    assert set(converted) == set(original)
    for name, w in original.items():
        got = converted[name].numpy()
        want = _expected(w, tensor_type)
        assert np.array_equal(got, want), f"{name}: max diff {np.abs(got - want).max()}"
        err = float(np.abs(got - w.numpy()).max())
        assert err <= ERROR_BOUND[tensor_type], f"{name}: error {err} vs the original"
    # The config says the same model (the GGUF stores rms_norm_eps as float32).
    a, b = ModelConfig.from_model_dir(tiny_model_dir), ModelConfig.from_model_dir(out)
    assert b.model_copy(update={"rms_norm_eps": a.rms_norm_eps}) == a


def test_tokenizer_chat_template_and_special_ids_survive(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    src = hf_to_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "Q8_0")
    out = convert_gguf(src, tmp_path / "hf", "bfloat16")
    want, got = Tokenizer.from_model_dir(tiny_model_dir), Tokenizer.from_model_dir(out)
    for text in TEXTS:
        assert got.encode(text) == want.encode(text), text
        ids = want.encode(text)
        assert got.decode(ids, skip_special_tokens=False) == want.decode(ids, False)
    assert (got.bos_id, got.eos_ids) == (want.bos_id, want.eos_ids)
    cfg_in = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    cfg_out = json.loads((out / "tokenizer_config.json").read_text())
    assert cfg_out["chat_template"] == cfg_in["chat_template"]
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"]) == (want.bos_id, want.eos_ids[0])
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16


# --- K-quants: raw random blocks, transformers' loader as the reference --------------------

# type -> (bytes per 256-value block, byte offsets of its float16 scale fields)
K_QUANTS = {
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
}
K_HIDDEN, K_HEADS, K_KV_HEADS = 256, 4, 2  # K-quant rows hold whole 256-value blocks


def _random_blocks(rng: np.random.Generator, rows: int, cols: int, tensor_type: str) -> np.ndarray:
    block_bytes, scale_offsets = K_QUANTS[tensor_type]
    raw = rng.integers(0, 256, size=(rows, cols // 256, block_bytes), dtype=np.uint8)
    scales = rng.uniform(1e-3, 1e-2, size=(rows, cols // 256, len(scale_offsets)))
    for i, off in enumerate(scale_offsets):  # finite scales, not random (NaN) bit patterns
        raw[:, :, off : off + 2] = scales[:, :, i : i + 1].astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def _write_k_quant_gguf(path: Path, tok_dir: Path, tensor_type: str) -> None:
    rng = np.random.default_rng(0)
    head_dim = K_HIDDEN // K_HEADS
    config = json.loads((tok_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(path), arch="llama")
    for add, value in (
        (w.add_block_count, 1),
        (w.add_context_length, 256),
        (w.add_embedding_length, K_HIDDEN),
        (w.add_feed_forward_length, K_HIDDEN),
        (w.add_head_count, K_HEADS),
        (w.add_head_count_kv, K_KV_HEADS),
        (w.add_rope_dimension_count, head_dim),
        (w.add_vocab_size, config["vocab_size"]),
    ):
        add(value)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    add_tokenizer(w, tok_dir, config)
    qtype = gguf.GGMLQuantizationType[tensor_type]
    shapes = {
        "token_embd.weight": (config["vocab_size"], K_HIDDEN),
        "output.weight": (config["vocab_size"], K_HIDDEN),
        "blk.0.attn_q.weight": (K_HIDDEN, K_HIDDEN),
        "blk.0.attn_k.weight": (K_KV_HEADS * head_dim, K_HIDDEN),
        "blk.0.attn_v.weight": (K_KV_HEADS * head_dim, K_HIDDEN),
        "blk.0.attn_output.weight": (K_HIDDEN, K_HIDDEN),
        "blk.0.ffn_gate.weight": (K_HIDDEN, K_HIDDEN),
        "blk.0.ffn_up.weight": (K_HIDDEN, K_HIDDEN),
        "blk.0.ffn_down.weight": (K_HIDDEN, K_HIDDEN),
    }
    for name, (rows, cols) in shapes.items():
        w.add_tensor(name, _random_blocks(rng, rows, cols, tensor_type), raw_dtype=qtype)
    for name in ("output_norm.weight", "blk.0.attn_norm.weight", "blk.0.ffn_norm.weight"):
        w.add_tensor(name, rng.uniform(0.8, 1.2, K_HIDDEN).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("tensor_type", sorted(K_QUANTS))
def test_k_quants_equal_transformers_gguf_loader(
    tiny_model_dir: Path, tmp_path: Path, tensor_type: str
) -> None:
    from transformers import AutoModelForCausalLM

    src = tmp_path / f"k-{tensor_type}.gguf"
    _write_k_quant_gguf(src, tiny_model_dir, tensor_type)
    out = convert_gguf(src, tmp_path / "hf", "float32")
    ref = AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=src.name, dtype=torch.float32
    ).state_dict()
    converted = load_file(str(out / "model.safetensors"))
    assert set(converted) == set(ref)
    for name, got in converted.items():
        assert torch.isfinite(got).all(), name
        diff = (got - ref[name]).abs().max().item()
        assert diff <= 1e-6, f"{name}: max |ours - transformers| = {diff}"


# --- errors ---------------------------------------------------------------------------------


def test_unsupported_architecture_is_named_and_nothing_is_written(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    src = hf_to_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "F16")
    raw = bytearray(src.read_bytes())
    # Rewrite the architecture string (u64 length 5, "llama") in place: "lamma", same length.
    pos = raw.find(b"\x05\x00\x00\x00\x00\x00\x00\x00llama")
    assert pos > 0
    raw[pos + 8 : pos + 13] = b"lamma"
    bad = tmp_path / "bad-arch.gguf"
    bad.write_bytes(bytes(raw))
    out = tmp_path / "out"
    with pytest.raises(GGUFConversionError, match=r"general\.architecture='lamma'"):
        convert_gguf(bad, out)
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad-arch.gguf", "tiny.gguf"]


def test_unsupported_tensor_type_is_named_and_nothing_is_written(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "iq.gguf"
    rng = np.random.default_rng(1)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    w = gguf.GGUFWriter(str(src), arch="llama")
    w.add_block_count(0)
    w.add_embedding_length(256)
    w.add_feed_forward_length(256)
    w.add_head_count(4)
    w.add_layer_norm_rms_eps(1e-5)
    add_tokenizer(w, tiny_model_dir, config)
    iq4 = gguf.GGMLQuantizationType.IQ4_NL  # 32 values in 18 bytes
    w.add_tensor(
        "token_embd.weight",
        rng.integers(0, 256, (config["vocab_size"], 256 // 32 * 18), dtype=np.uint8),
        raw_dtype=iq4,
    )
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    out = tmp_path / "out"
    assert main(["convert", "--gguf", str(src), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "'token_embd.weight' has type IQ4_NL, which is not supported" in err
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir()] == ["iq.gguf"]


def test_existing_output_folder_is_refused(tiny_model_dir: Path, tmp_path: Path) -> None:
    src = hf_to_gguf(tiny_model_dir, tmp_path / "tiny.gguf", "F16")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(GGUFConversionError, match="not empty"):
        convert_gguf(src, out)
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


# --- weights kept quantized (--weights keep) -------------------------------------------------


@pytest.mark.parametrize("tensor_type", ["Q8_0", "Q4_0", "Q4_1", "F16"])
def test_keep_stores_the_files_blocks(
    tiny_model_dir: Path, tmp_path: Path, tensor_type: str
) -> None:
    """`--weights keep`: each Q8_0 / Q4_0 / Q4_1 matrix is its rows' blocks as the file holds
    them (q/k rows unpermuted whole), listed in quantization_config, and dequantizes to what
    the dequantizing conversion writes; other types (F16 here, norms always) are dequantized."""
    from model_runtime.quant import dequantize_blocks

    src = hf_to_gguf(tiny_model_dir, tmp_path / f"tiny-{tensor_type}.gguf", tensor_type)
    kept, plain = tmp_path / "kept", tmp_path / "plain"
    argv = ["convert", "--gguf", str(src), "--dtype", "float32"]
    assert main([*argv, "--out", str(kept), "--weights", "keep"]) == 0
    assert main([*argv, "--out", str(plain)]) == 0
    config = json.loads((kept / "config.json").read_text())
    want = load_file(str(plain / "model.safetensors"))
    got = load_file(str(kept / "model.safetensors"))
    assert set(got) == set(want)
    if tensor_type == "F16":
        assert "quantization_config" not in config
        assert all(torch.equal(got[n], want[n]) for n in want)
        return
    types = config["quantization_config"]["tensor_types"]
    assert config["quantization_config"]["quant_method"] == "ggml"
    assert set(types) == {n for n, t in want.items() if t.dim() == 2}
    assert set(types.values()) == {tensor_type}
    for name, w in want.items():
        if name in types:
            assert got[name].dtype == torch.uint8, name
            assert torch.equal(dequantize_blocks(got[name], tensor_type, w.shape[1]), w), name
        else:
            assert torch.equal(got[name], w), name
    assert json.loads((kept / "gguf_source.json").read_text())["weights"] == "keep"
    assert ModelConfig.from_model_dir(kept).weights_label() == tensor_type


def test_quantize_cli_writes_a_folder_served_quantized(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`pdserve quantize --to q4`: layer matrices Q4_1, embedding Q8_0, norms float; the folder
    loads with every Linear kept quantized; a second quantization and a taken --out refused."""
    from model_runtime.model_runner import ModelRunner

    out = tmp_path / "q4"
    argv = ["quantize", "--model", str(tiny_model_dir), "--to", "q4", "--dtype", "float32"]
    assert main([*argv, "--out", str(out)]) == 0
    cfg = ModelConfig.from_model_dir(out)
    assert cfg.quantization is not None and cfg.weights_label() == "Q4_1+Q8_0"
    assert cfg.quantization.tensor_types["model.embed_tokens.weight"] == "Q8_0"
    runner = ModelRunner.from_model_dir(out, 8, 16, dtype="float32")
    assert runner.model.embed_quant is not None
    assert runner.model.layers[0].mlp.down_proj.quant is not None
    assert main([*argv, "--out", str(out)]) == 2  # not empty
    assert (
        main(["quantize", "--model", str(out), "--to", "int8", "--out", str(tmp_path / "x")]) == 2
    )
