"""The runner's logits equal HF transformers' for every supported architecture and option.

Models are built by transformers itself (random weights, q/k scaled up so attention is sharp) and
saved as HF folders; our loader reads them back. Float32 throughout: differences are ~1e-6.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model_runtime.config import ModelConfig
from model_runtime.kernels import panel_gemm
from model_runtime.model_runner import ModelRunner, StepInput

transformers = pytest.importorskip("transformers")

VOCAB = 320


def _hf_model(kind: str, out: Path, **extra: object) -> torch.nn.Module:
    torch.manual_seed(1234)
    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        dtype="float32",
    )
    common.update(extra)
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    elif kind == "mistral":
        model = transformers.MistralForCausalLM(
            transformers.MistralConfig(sliding_window=None, **common)
        )
    else:
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(6)
            layer.self_attn.k_proj.weight.mul_(6)
            if layer.self_attn.q_proj.bias is not None:
                layer.self_attn.q_proj.bias.normal_(0, 0.5)
                layer.self_attn.k_proj.bias.normal_(0, 0.5)
    model.eval().save_pretrained(out)
    return model


def _run_chunked(runner: ModelRunner, ids: list[int]) -> torch.Tensor:
    """Logits at every position after the first chunk: chunk of 13, then one token at a time."""
    table = list(range(3, 3 + 20))
    first = 13
    out = [runner.execute([StepInput(ids[:first], 0, table)])[0]]
    for pos in range(first, len(ids)):
        out.append(runner.execute([StepInput([ids[pos]], pos, table)])[0])
    return torch.stack(out)


CASES = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama3-rope": (
        "llama",
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "mistral": ("mistral", {}),
    "qwen2-bias": ("qwen2", {}),
}


@pytest.mark.parametrize("kernel", ["auto", "avx2"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_hf(case: str, kernel: str, tmp_path: Path) -> None:
    """Prefill chunk then decode steps; with the `avx2` kernel the decode steps run the fused
    C step (`kernels.decode_step`) wherever the model supports it."""
    if kernel == "avx2" and panel_gemm.load() is None:
        pytest.skip(f"avx2 panel kernel unavailable: {panel_gemm.unavailable_reason()}")
    kind, extra = CASES[case]
    hf = _hf_model(kind, tmp_path, **extra)
    ids = torch.randint(3, VOCAB, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, 12:]
    runner = ModelRunner.from_model_dir(
        tmp_path,
        num_blocks=32,
        block_size=4,
        dtype="float32",
        linear_kernel=kernel,  # type: ignore[arg-type]
    )
    if kernel == "avx2":
        assert runner.decode_path == "fused" or runner.fused_unsupported, case
    ours = _run_chunked(runner, ids)
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-4, f"{case}: max abs logit diff {diff}"
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_sharded_checkpoint_and_bf16(tmp_path: Path) -> None:
    """A checkpoint split over two shards in bfloat16 loads and runs in bfloat16."""
    _hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    weight_map = {}
    for fname, part in halves.items():
        save_file({n: tensors[n].to(torch.bfloat16).contiguous() for n in part}, tmp_path / fname)
        weight_map |= {n: fname for n in part}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    runner = ModelRunner.from_model_dir(tmp_path, num_blocks=8, block_size=8, dtype="auto")
    assert runner.kv_cache.kv.dtype == torch.float32  # config says float32
    bf16 = ModelRunner.from_model_dir(tmp_path, num_blocks=8, block_size=8, dtype="bfloat16")
    a = runner.execute([StepInput([5, 6, 7, 8], 0, [0])])
    b = bf16.execute([StepInput([5, 6, 7, 8], 0, [0])])
    assert bf16.model.embed_tokens.dtype == torch.bfloat16
    assert (a - b).abs().max().item() < 0.5


def test_bad_checkpoint_names_the_tensor(tmp_path: Path) -> None:
    _hf_model("llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.0.mlp.up_proj.weight.*shape \(3, 3\)"):
        ModelRunner.from_model_dir(tmp_path, num_blocks=8, block_size=8)
    del tensors["model.layers.0.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"missing tensors.*up_proj"):
        ModelRunner.from_model_dir(tmp_path, num_blocks=8, block_size=8)


BASE = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 100,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architectures"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"torch_dtype": "float64"}, "torch_dtype='float64'"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 2.0}}, "rope_type='yarn'"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 64}, "sliding_window=64"),
    ],
)
def test_unsupported_config_names_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ModelConfig.from_hf_dict(BASE | change)


def test_missing_required_field() -> None:
    raw = dict(BASE)
    del raw["vocab_size"]
    with pytest.raises(ValueError, match="vocab_size"):
        ModelConfig.from_hf_dict(raw)
