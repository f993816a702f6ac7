"""`model_runtime.quant`: ggml blocks, their torch reference and the kernels' panel layout.

The reference (`dequantize_blocks`) must give the `gguf` package's values bit for bit (it is
what `pdserve convert` and transformers' GGUF loader use); `pack_blocks` / `unpack_blocks` must
round-trip any row count (padding to 64 rows) and any K that is a multiple of 32; bad input is
a ValueError naming what is wrong.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from model_runtime import quant
from model_runtime.config import QUANT_TYPES


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    w[0, :32] = 0.0  # an all-zero block: scale 0
    return w


@pytest.mark.parametrize("qtype", QUANT_TYPES)
def test_reference_is_the_gguf_package_bit_for_bit(qtype: quant.QuantType) -> None:
    raw = quant.quantize(_weight(70, 96), qtype)
    assert raw.dtype == torch.uint8 and raw.shape == (70, quant.row_bytes(qtype, 96))
    want = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType[qtype])
    got = quant.dequantize_blocks(raw, qtype, 96)
    assert np.array_equal(got.numpy(), np.asarray(want, np.float32).reshape(70, 96))


@pytest.mark.parametrize("qtype", QUANT_TYPES)
@pytest.mark.parametrize(("n", "k"), [(1, 32), (63, 64), (64, 96), (65, 576), (130, 32)])
def test_panels_round_trip_and_dequantize_like_the_blocks(
    qtype: quant.QuantType, n: int, k: int
) -> None:
    raw = quant.quantize(_weight(n, k, seed=n + k), qtype)
    qw = quant.pack_blocks(raw, qtype, k)
    groups = -(-n // quant.GROUP)
    block_bytes = quant.BLOCK_BYTES[qtype] * quant.GROUP
    assert qw.panels.shape == (groups, k // quant.BLOCK * block_bytes)
    assert (qw.out_features, qw.in_features, qw.nbytes) == (n, k, qw.panels.numel())
    assert torch.equal(quant.unpack_blocks(qw), raw)
    ref = quant.dequantize_blocks(raw, qtype, k)
    assert torch.equal(quant.dequantize(qw), ref)
    ids = torch.tensor([[n - 1, 0], [n // 2, n - 1]])
    assert torch.equal(quant.dequantize_rows(qw, ids), ref[ids])


def test_concatenated_rows_pack_as_one_weight() -> None:
    """The loader fuses q/k/v by concatenating their blocks' rows."""
    parts = [quant.quantize(_weight(n, 64, seed=n), "Q4_1") for n in (48, 16, 16)]
    qw = quant.pack_blocks(torch.cat(parts), "Q4_1", 64)
    want = torch.cat([quant.dequantize_blocks(p, "Q4_1", 64) for p in parts])
    assert torch.equal(quant.dequantize(qw), want)


def test_bad_input_says_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="'Q5_K' is not supported"):
        quant.check_type("Q5_K")
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.row_bytes("Q8_0", 40)
    with pytest.raises(ValueError, match=r"uint8 \[N, 34\]"):
        quant.pack_blocks(torch.zeros(4, 35, dtype=torch.uint8), "Q8_0", 32)
    with pytest.raises(ValueError, match="only matrices"):
        quant.quantize(torch.zeros(32), "Q8_0")
    qw = quant.pack_blocks(quant.quantize(_weight(8, 32), "Q8_0"), "Q8_0", 32)
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        quant.dequantize_rows(qw, torch.tensor([8]))


def test_config_reads_the_quantization_config() -> None:
    """config.json's `quantization_config` names the kept tensors; the label lists the types
    most used first; other quantization methods are refused naming the field."""
    from model_runtime.config import ModelConfig

    raw = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "torch_dtype": "bfloat16",
    }
    assert ModelConfig.from_hf_dict(raw).weights_label() == "bfloat16"
    assert ModelConfig.from_hf_dict(raw).weights_label("float32") == "float32"
    types = {"a.weight": "Q4_1", "b.weight": "Q4_1", "model.embed_tokens.weight": "Q8_0"}
    cfg = ModelConfig.from_hf_dict(
        raw | {"quantization_config": {"quant_method": "ggml", "tensor_types": types}}
    )
    assert cfg.quantization is not None and cfg.quantization.tensor_types == types
    assert cfg.weights_label() == "Q4_1+Q8_0"
    with pytest.raises(ValueError, match=r"quantization_config.quant_method='gptq'"):
        ModelConfig.from_hf_dict(raw | {"quantization_config": {"quant_method": "gptq"}})
    with pytest.raises(ValueError, match="Q5_K"):
        ModelConfig.from_hf_dict(
            raw | {"quantization_config": {"quant_method": "ggml", "tensor_types": {"a": "Q5_K"}}}
        )
