"""Quantize an HF model folder's weights into a kept-quantized folder (`pdserve quantize`).

Runs in the CLI process and in tests; never in a worker. The output is the format
`pdserve convert --weights keep` writes (`model_runtime.config.WeightQuantization`): the same
config.json (plus `quantization_config`), tokenizer and generation files, and a
model.safetensors whose matrices are ggml blocks, made by the `gguf` package's quantizers
(`model_runtime.quant.quantize`, llama.cpp's reference quantization). Targets:

    int8 (= q8_0)  every matrix Q8_0: int8 values, one fp16 scale per 32 (symmetric)
    q4   (= q4_1)  layer matrices Q4_1: 4-bit codes, one fp16 scale and minimum per 32; the
                   embedding and LM head Q8_0 (as llama.cpp's Q4 files keep token_embd and
                   output at a wider type: they are the most sensitive tensors)
    q4_0           layer matrices Q4_0 (symmetric, one scale per 32); embedding and head Q8_0

Norms, biases and anything that is not a matrix stay float, in `dtype` (default: the source's
own). Nothing is written when the source cannot be read, and the folder appears only once
complete (written into a temporary sibling, then renamed), as `pdserve convert` does.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Literal, get_args

Target = Literal["int8", "q8_0", "q4", "q4_1", "q4_0"]
_LAYER_TYPE = {"int8": "Q8_0", "q8_0": "Q8_0", "q4": "Q4_1", "q4_1": "Q4_1", "q4_0": "Q4_0"}
_HEAD_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")
_COPIED = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def tensor_types(names: list[str], target: Target) -> dict[str, str]:
    """The ggml type each matrix `names` gets for `target` (module doc)."""
    layer = _LAYER_TYPE[target]
    return {n: ("Q8_0" if n in _HEAD_TENSORS else layer) for n in names}


def quantize_folder(
    src: str | Path, out: str | Path, target: Target, dtype: str | None = None
) -> Path:
    """Write `src`'s model quantized to `target` into the new folder `out`; returns `out`.

    ValueError for an unknown target or dtype, a folder pdserve cannot load (the same checks
    as a worker's), a source that is already quantized, or a non-empty `out`.
    """
    import torch
    from safetensors.torch import save_file

    from model_runtime.config import ModelConfig
    from model_runtime.quant import BLOCK, quantize
    from model_runtime.weights import read_checkpoint

    if target not in get_args(Target):
        raise ValueError(f"--to {target!r} is not supported; supported: {list(get_args(Target))}")
    src, dst = Path(src), Path(out)
    config = ModelConfig.from_model_dir(src)
    if config.quantization is not None:
        raise ValueError(f"{src} is already quantized ({config.quantization.label()})")
    dtype = dtype or config.torch_dtype
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype {dtype!r} is not supported; supported: float32, bfloat16, float16")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise ValueError(f"{dst} already exists and is not empty; choose another --out")
    tensors = read_checkpoint(src, config)
    matrices = [n for n, t in tensors.items() if t.dim() == 2 and t.shape[1] % BLOCK == 0]
    types = tensor_types(matrices, target)
    torch_dtype = getattr(torch, dtype)
    stored = {
        name: quantize(t, types[name]) if name in types else t.to(torch_dtype).contiguous()  # type: ignore[arg-type]
        for name, t in tensors.items()
    }
    raw_config = json.loads((src / "config.json").read_text())
    raw_config["torch_dtype"] = dtype
    raw_config["quantization_config"] = {"quant_method": "ggml", "tensor_types": types}
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", suffix=".partial", dir=dst.parent))
    try:
        save_file(stored, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(raw_config, indent=2) + "\n")
        for name in _COPIED:
            if (src / name).is_file():
                shutil.copyfile(src / name, tmp / name)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        os.chmod(tmp, 0o755)
        if dst.exists():
            dst.rmdir()  # empty (checked above)
        os.rename(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dst
