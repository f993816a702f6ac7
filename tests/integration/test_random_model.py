"""Random test models: determinism, folder contents, HF loading, and oracle strength."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from model_runtime.config import ModelConfig
from model_runtime.tokenizer import Tokenizer
from tooling.models.random_model import BOS_ID, EOS_ID, PAD_ID, PRESETS, make_random_model

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _hf_names(num_layers: int) -> set[str]:
    per_layer = [
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    ]
    names = {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    names |= {f"model.layers.{i}.{n}.weight" for i in range(num_layers) for n in per_layer}
    return names


def test_same_seed_same_bytes_different_seed_different_weights(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    again = make_random_model(tmp_path / "again", "tiny", seed=0)
    other = make_random_model(tmp_path / "other", "tiny", seed=1)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    # The tokenizer does not depend on the weight seed.
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_every_file_gets_the_same_permissions(tmp_path: Path) -> None:
    """The weights are readable like the other files (safetensors writes a 0600 temp file)."""
    old = os.umask(0o022)
    try:
        out = make_random_model(tmp_path / "m", "tiny", seed=0)
    finally:
        os.umask(old)
    modes = {f.name: oct(f.stat().st_mode & 0o777) for f in out.iterdir()}
    assert set(modes.values()) == {"0o644"}, modes
    assert "model.safetensors" in modes


def test_tokenizer_training_is_independent_of_process_hashing() -> None:
    code = (
        "import hashlib; from tooling.models.corpus import train_tokenizer; "
        "print(hashlib.sha256(train_tokenizer(1024, 20000).to_str().encode()).hexdigest())"
    )
    digests = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""},
            cwd=Path(__file__).resolve().parents[2],
        ).stdout
        for seed in ("1", "2")
    }
    assert len(digests) == 1, digests


def test_folder_contents_match_config(tiny_model_dir: Path) -> None:
    preset = PRESETS["tiny"]
    cfg = ModelConfig.from_model_dir(tiny_model_dir)
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    weights = load_file(str(tiny_model_dir / "model.safetensors"))

    assert cfg.vocab_size == tok.vocab_size == preset.vocab_size == 1024
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads) == (4, 128, 4)
    assert cfg.num_key_value_heads == 2 and cfg.head_dim == 32
    assert cfg.max_position_embeddings == 1024 and cfg.rope_theta == 10000.0
    assert cfg.torch_dtype == "float32" and not cfg.tie_word_embeddings
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.pad_token_id) == (BOS_ID, (EOS_ID,), PAD_ID)
    assert (tok.bos_id, tok.eos_ids) == (BOS_ID, (EOS_ID,))

    assert set(weights) == _hf_names(cfg.num_hidden_layers)
    assert all(w.dtype == torch.float32 for w in weights.values())
    assert weights["model.embed_tokens.weight"].shape == (cfg.vocab_size, cfg.hidden_size)
    assert weights["model.layers.0.self_attn.k_proj.weight"].shape == (64, 128)
    n_params = sum(w.numel() for w in weights.values())
    assert n_params == preset.num_parameters()
    print(f"tiny preset: {n_params:,} parameters")

    lm_head = weights["lm_head.weight"]
    assert torch.all(lm_head[[BOS_ID, EOS_ID, PAD_ID]] == 0)
    assert not torch.equal(lm_head, weights["model.embed_tokens.weight"])  # untied
    norm = weights["model.layers.0.input_layernorm.weight"]
    assert 0.05 < norm.std().item() < 0.2 and abs(norm.mean().item() - 1.0) < 0.05


def test_small_preset_size() -> None:
    p = PRESETS["small"]
    n = p.num_parameters()
    print(f"small preset: {n:,} parameters ({n * 4 / 2**20:.0f} MiB in float32)")
    assert 100e6 <= n <= 150e6
    assert (p.num_hidden_layers, p.hidden_size, p.intermediate_size) == (12, 768, 3072)
    assert (p.num_attention_heads, p.num_key_value_heads) == (12, 4)
    assert 8192 <= p.vocab_size <= 16384 and p.max_position_embeddings == 4096


@pytest.mark.slow
def test_small_preset_builds(tmp_path: Path) -> None:
    out = make_random_model(tmp_path / "small", "small", seed=0)
    try:
        cfg = ModelConfig.from_model_dir(out)
        tok = Tokenizer.from_model_dir(out)
        assert cfg.vocab_size == tok.vocab_size == PRESETS["small"].vocab_size
        weights = load_file(str(out / "model.safetensors"))
        assert sum(w.numel() for w in weights.values()) == PRESETS["small"].num_parameters()
    finally:
        shutil.rmtree(out)  # ~0.5 GB; pytest keeps the last runs' tmp folders


def test_bad_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="preset"):
        make_random_model(tmp_path, "huge")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="seed"):
        make_random_model(tmp_path, "tiny", seed=-1)


# ---------------------------------------------------------------- HF transformers


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path):  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")
    model, info = transformers.LlamaForCausalLM.from_pretrained(
        tiny_model_dir, attn_implementation="eager", output_loading_info=True
    )
    assert not any(info.values()), info  # no missing / unexpected / mismatched weights
    return model.eval()


def test_hf_tokenizer_agrees(tiny_model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    hf_tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    assert len(hf_tok) == tok.vocab_size
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id, hf_tok.pad_token_id) == (0, 1, 2)
    for text in ("The river rises in the mountains.", "Zoë — café 🙂 語"):
        ids = hf_tok(text).input_ids
        assert ids == tok.encode(text)
        assert hf_tok.decode(ids, skip_special_tokens=True) == tok.decode(ids) == text


def test_hf_config_matches(hf_model) -> None:  # type: ignore[no-untyped-def]
    c = hf_model.config
    rope = getattr(c, "rope_parameters", None) or {"rope_theta": c.rope_theta}
    assert rope["rope_theta"] == 10000.0
    assert (c.vocab_size, c.num_key_value_heads, c.head_dim) == (1024, 2, 32)
    assert hf_model.dtype == torch.float32


def _random_prompts(n: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    lengths = torch.randint(8, 60, (n,), generator=g).tolist()
    return [torch.randint(3, 1024, (1, length), generator=g) for length in lengths]


def test_random_model_is_a_strong_oracle(hf_model) -> None:  # type: ignore[no-untyped-def]
    """DESIGN section 5: sharp attention, position-sensitive, specials never the argmax."""
    max_attn, flipped, prompts = [], 0, _random_prompts(30)
    with torch.no_grad():
        for ids in prompts:
            out = hf_model(ids, output_attentions=True)
            # Mean over layers, heads and positions (past the first few) of the largest weight.
            att = torch.stack(out.attentions)[..., 4:, :]
            max_attn.append(att.max(-1).values.mean().item())
            # Off-by-one RoPE position on the last token only (a typical decode bug).
            pos = torch.arange(ids.shape[1])[None].clone()
            pos[0, -1] += 1
            shifted = hf_model(ids, position_ids=pos).logits[0, -1]
            flipped += int(shifted.argmax() != out.logits[0, -1].argmax())
            # Special tokens' logits are exactly 0 and never the largest.
            assert torch.all(out.logits[0, :, [BOS_ID, EOS_ID, PAD_ID]] == 0)
            assert torch.all(out.logits[0].argmax(-1) > PAD_ID)
    mean_max = sum(max_attn) / len(max_attn)
    print(f"mean max attention {mean_max:.3f}; off-by-one flips {flipped}/{len(prompts)}")
    assert mean_max > 0.7, "attention is too uniform to catch position bugs"
    assert flipped >= 0.7 * len(prompts)


def test_greedy_generation_does_not_collapse(hf_model) -> None:  # type: ignore[no-untyped-def]
    # A random model that repeats one token would hide decode bugs; this one keeps varying.
    ids = torch.tensor([[BOS_ID, 60, 81, 130, 107]])
    out = hf_model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=None)
    new = out[0, ids.shape[1] :].tolist()
    assert len(new) == 40 and len(set(new)) > 20, new


def test_config_json_is_standard_hf(tiny_model_dir: Path) -> None:
    raw = json.loads((tiny_model_dir / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLM"] and raw["model_type"] == "llama"
    assert raw["torch_dtype"] == "float32"
