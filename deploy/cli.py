"""The `pdserve` command line: one argparse parser with a subcommand per action.

Runs in the CLI process (`pdserve ...` or `python -m deploy.cli ...`). Subcommands import their
heavy dependencies (torch, the engine) only when they run, so `pdserve --help` is fast.

    pdserve make-model --preset tiny|small --out DIR [--seed N]
    pdserve batch --model DIR --input IN.jsonl --output OUT.jsonl [engine options]
    pdserve demo [--model DIR] [--preset small] [--out RUN_DIR]   (what `make demo` runs)

A subcommand module exposes `add_<name>_parser(subparsers)`, which registers its parser and sets
`func` to a function `(argparse.Namespace) -> int` returning the exit code.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from deploy.batch import add_batch_parser


def add_make_model_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `make-model`: write a random-weight Llama model folder (tests, demo, bench)."""
    p = subparsers.add_parser(
        "make-model",
        help="write a random-weight Llama model folder",
        description="Write a random-weight HF Llama folder (config.json, model.safetensors, "
        "tokenizer.json). Same preset and seed give byte-identical files.",
    )
    p.add_argument("--preset", choices=["tiny", "small"], default="tiny")
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed (default 0)")
    p.set_defaults(func=make_model_main)


def make_model_main(args: argparse.Namespace) -> int:
    from model_runtime.random_model import PRESETS, make_random_model

    try:
        out = make_random_model(args.out, args.preset, args.seed)
    except ValueError as exc:
        print(f"pdserve make-model: {exc}", file=sys.stderr)
        return 2
    n = PRESETS[args.preset].num_parameters()
    print(f"wrote {args.preset} model ({n / 1e6:.2f}M parameters, seed {args.seed}) to {out}")
    return 0


def add_demo_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `demo`: make a random model if missing, then batch a few prompts through it."""
    p = subparsers.add_parser(
        "demo",
        help="make a random model if missing and run a small batch through the engine",
        description="Build a random-weight model into --model unless it already holds one, "
        "write demo prompts to OUT/input.jsonl, run `pdserve batch` on them into "
        "OUT/output.jsonl and print a summary.",
    )
    p.add_argument("--model", default="models/small", help="model folder (default models/small)")
    p.add_argument("--preset", choices=["tiny", "small"], default="small")
    p.add_argument("--out", default="runs/demo", help="run folder (default runs/demo)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.set_defaults(func=demo_main)


def demo_prompts(n: int, max_tokens: int) -> list[dict[str, object]]:
    """`n` deterministic request lines: corpus sentences, half behind a shared system prefix
    (so prefix caching has something to reuse), one sampled with a seed."""
    from model_runtime.corpus import PROSE

    sentences = [s.strip() for s in PROSE.replace("\n", " ").split(". ") if len(s) > 40]
    system = "You are the keeper of the lighthouse. Answer briefly and in plain words. "
    lines: list[dict[str, object]] = []
    for i in range(n):
        prompt = sentences[i % len(sentences)] + "."
        line: dict[str, object] = {"id": f"demo-{i}", "max_tokens": max_tokens}
        line["prompt"] = system + prompt if i % 2 else prompt
        if i == n - 1:
            line.update(temperature=0.8, top_p=0.95, seed=1234)
        lines.append(line)
    return lines


def demo_main(args: argparse.Namespace) -> int:
    from deploy.batch import run_batch
    from model_runtime.random_model import make_random_model

    model, out = Path(args.model), Path(args.out)
    if args.num_prompts < 1 or args.max_tokens < 1:
        print("pdserve demo: --num-prompts and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    if not (model / "config.json").is_file():
        print(f"pdserve demo: building the {args.preset} random model in {model} ...")
        make_random_model(model, args.preset, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    inp = out / "input.jsonl"
    inp.write_text(
        "".join(json.dumps(x) + "\n" for x in demo_prompts(args.num_prompts, args.max_tokens))
    )
    try:
        summary = run_batch(model, inp, out / "output.jsonl")
    except ValueError as exc:
        print(f"pdserve demo: {exc}", file=sys.stderr)
        return 2
    results = [json.loads(x) for x in (out / "output.jsonl").read_text().splitlines()]
    for r in results[:4]:
        u = r["usage"]
        print(
            f"{r['id']}: {u['prompt_tokens']} prompt tokens ({u['cached_tokens']} cached) -> "
            f"{u['completion_tokens']} tokens, {r['finish_reason']}: {r['text'][:48]!r}"
        )
    tps = summary.completion_tokens / max(summary.seconds, 1e-9)
    print(
        f"{summary.num_lines} requests, {summary.prompt_tokens} prompt tokens "
        f"({summary.cached_tokens} from the prefix cache), {summary.completion_tokens} generated "
        f"in {summary.seconds:.2f}s ({tps:.0f} tokens/s incl. load); outputs in {out}/output.jsonl"
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument(
        "--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_make_model_parser(sub)
    add_batch_parser(sub)
    add_demo_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `pdserve`; returns the exit code (argparse exits 2 on bad usage)."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
