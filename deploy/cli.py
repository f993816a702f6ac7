"""The `pdserve` command line: one argparse parser with a subcommand per action.

Runs in the CLI process (`pdserve ...` or `python -m deploy.cli ...`). Subcommands import their
heavy dependencies (torch, the engine) only when they run, so `pdserve --help` is fast.

    pdserve make-model --preset tiny|small|tiny-draft|small-draft --out DIR [--seed N]
                       [--dtype float32|bfloat16]
    pdserve pull smollm2-135m-instruct [--out DIR] [--dtype bfloat16|float16|float32]
                 [--weights dequantize|keep]
    pdserve convert --gguf FILE --out DIR [--dtype bfloat16|float16|float32]
                    [--weights dequantize|keep]
    pdserve quantize --model DIR --out DIR --to int8|q4|q4_0 [--dtype ...]
    pdserve batch --model DIR --input IN.jsonl --output OUT.jsonl [engine options]
    pdserve demo [--model DIR] [--out RUN_DIR]     (what `make demo` runs: one chat, then goodput)
    pdserve batch-demo [--model DIR] [--preset small] [--out RUN_DIR]   (engine only, seconds)
    pdserve up [--config FILE.toml] [--model DIR] [--mode disagg|colocated] [--prefill N]
               [--decode M] [--colocated K] [--port P] [--http-port Q] [--ray-address ADDR]
               [--no-ray]
    pdserve generate --addr HOST:PORT (--prompt TEXT | --token-ids 1,2,3) [sampling] [--json]
    pdserve soak --model DIR --out DIR [--requests N] [--faults LIST] ...   (chaos soak)

A subcommand module exposes `add_<name>_parser(subparsers)`, which registers its parser and sets
`func` to a function `(argparse.Namespace) -> int` returning the exit code.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from deploy.batch import add_batch_parser
from deploy.bench_cli import add_bench_parser, add_goodput_demo_parser, add_report_parser
from deploy.cli_help import use_defaults_help
from deploy.client import add_generate_parser
from deploy.models_cli import add_convert_parser, add_pull_parser, add_quantize_parser
from deploy.plan_cli import add_plan_parser
from deploy.profile_cli import add_profile_parser
from deploy.simulate_cli import add_simulate_parser
from deploy.soak_cli import add_soak_parser
from security.cli import add_server_security_args, server_security_overrides

if TYPE_CHECKING:
    from deploy.config import ClusterConfig
    from deploy.supervision import SupervisionEvent
    from security.secret import ClusterSecret
    from tooling.launch import Workers

log = logging.getLogger("pdserve")


def add_make_model_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `make-model`: write a random-weight Llama model folder (tests, demo, bench)."""
    p = subparsers.add_parser(
        "make-model",
        help="write a random-weight Llama model folder",
        description="Write a random-weight HF Llama folder (config.json, model.safetensors, "
        "tokenizer.json). Same preset and seed give byte-identical files.",
    )
    p.add_argument(
        "--preset",
        choices=["tiny", "small", "tiny-draft", "small-draft"],
        default="tiny",
        help="model size: tiny (~1 M parameters, tests) or small (~129 M, benchmarks); "
        "tiny-draft / small-draft: smaller models with the same tokenizer (speculative "
        "decoding drafts for tiny / small)",
    )
    p.add_argument("--out", required=True, help="output folder (created if missing)")
    p.add_argument("--seed", type=int, default=0, help="weight seed")
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="checkpoint dtype (config.json torch_dtype; 'auto' engines run in it)",
    )
    p.add_argument(
        "--if-missing", action="store_true", help="do nothing if OUT already holds a config.json"
    )
    p.set_defaults(func=make_model_main)


def make_model_main(args: argparse.Namespace) -> int:
    from tooling.models.random_model import PRESETS, make_random_model

    if args.if_missing and (Path(args.out) / "config.json").is_file():
        print(f"model already present in {args.out}")
        return 0
    try:
        out = make_random_model(args.out, args.preset, args.seed, args.dtype)
    except ValueError as exc:
        print(f"pdserve make-model: {exc}", file=sys.stderr)
        return 2
    n = PRESETS[args.preset].num_parameters()
    print(
        f"wrote {args.preset} model ({n / 1e6:.2f}M parameters, {args.dtype}, seed {args.seed}) "
        f"to {out}"
    )
    return 0


def add_batch_demo_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Register `batch-demo`: make a random model if missing, then batch a few prompts through
    the colocated engine (a quick check that a machine can run models; `demo` is the main job)."""
    p = subparsers.add_parser(
        "batch-demo",
        help="make a random model if missing and run a small batch through the engine",
        description="Build a random-weight model into --model unless it already holds one, "
        "write demo prompts to OUT/input.jsonl, run `pdserve batch` on them into "
        "OUT/output.jsonl and print a summary.",
    )
    p.add_argument("--model", default="models/small", help="model folder")
    p.add_argument(
        "--preset", choices=["tiny", "small"], default="small", help="model to build if missing"
    )
    p.add_argument("--out", default="runs/batch-demo", help="run folder")
    p.add_argument("--num-prompts", type=int, default=16, help="demo prompts to run")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens to generate per prompt")
    p.set_defaults(func=batch_demo_main)


def demo_prompts(n: int, max_tokens: int) -> list[dict[str, object]]:
    """`n` deterministic request lines: corpus sentences, half behind a shared system prefix
    (so prefix caching has something to reuse), one sampled with a seed."""
    from tooling.models.corpus import PROSE

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


def batch_demo_main(args: argparse.Namespace) -> int:
    from deploy.batch import run_batch
    from tooling.models.random_model import make_random_model

    model, out = Path(args.model), Path(args.out)
    if args.num_prompts < 1 or args.max_tokens < 1:
        print("pdserve batch-demo: --num-prompts and --max-tokens must be >= 1", file=sys.stderr)
        return 2
    if not (model / "config.json").is_file():
        print(f"pdserve batch-demo: building the {args.preset} random model in {model} ...")
        make_random_model(model, args.preset, seed=0)
    out.mkdir(parents=True, exist_ok=True)
    inp = out / "input.jsonl"
    inp.write_text(
        "".join(json.dumps(x) + "\n" for x in demo_prompts(args.num_prompts, args.max_tokens))
    )
    try:
        summary = run_batch(model, inp, out / "output.jsonl")
    except ValueError as exc:
        print(f"pdserve batch-demo: {exc}", file=sys.stderr)
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


def add_up_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `up`: start workers (Ray actors or subprocesses) and serve the router here."""
    p = subparsers.add_parser(
        "up",
        help="start a serving cluster: workers + the router (until Ctrl-C / SIGTERM)",
        description="Start the workers of a cluster (Ray actors, or local processes with "
        "--no-ray), then run the public router in this process. Prints 'pdserve ready: "
        "HOST:PORT (...)' once it serves (plus ' http URL' with --http-port); Ctrl-C or "
        "SIGTERM stops everything it started. "
        "Flags override the --config file. --mode alone also zeroes the counts of roles that "
        "mode does not use; --ray-address drops the file's ray.num_cpus (local clusters only).",
    )
    # Unset flags keep the --config file's value, else the built-in default named here.
    p.add_argument(
        "--config", help="cluster TOML file, see deploy/examples/ (default: built-in defaults)"
    )
    p.add_argument("--model", help="HF model folder (default: the file's `model`)")
    p.add_argument(
        "--mode",
        choices=["disagg", "colocated"],
        help="serving mode (default: the file's, else disagg)",
    )
    p.add_argument("--prefill", type=int, help="prefill workers (default: the file's, else 1)")
    p.add_argument("--decode", type=int, help="decode workers (default: the file's, else 1)")
    p.add_argument("--colocated", type=int, help="colocated workers (default: the file's, else 1)")
    p.add_argument(
        "--port", type=int, help="router port, 0 picks a free one (default: the file's, else 50051)"
    )
    p.add_argument(
        "--http-port",
        type=int,
        help="serve the OpenAI-compatible HTTP API and /metrics on this port, 0 picks a free "
        "one (default: the file's, else none)",
    )
    p.add_argument("--host", help="router interface (default: the file's, else 127.0.0.1)")
    p.add_argument(
        "--torch-threads", type=int, help="torch threads per worker (default: the file's, else 1)"
    )
    p.add_argument(
        "--ray-address",
        help="join this Ray cluster: 'auto', 'host:6379', 'ray://host:10001' (default: the "
        "file's, else start a local Ray cluster sized for the workers)",
    )
    p.add_argument("--no-ray", action="store_true", help="workers as plain local processes")
    p.add_argument(
        "--redis-url",
        help="shared prefix index in Redis, redis://host:port/db (default: the file's, else an "
        "in-memory index in the router)",
    )
    p.add_argument("--log-dir", help="worker logs with --no-ray (default: a temp folder)")
    add_server_security_args(p)
    p.set_defaults(func=up_main, default_log_level="INFO")


def up_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """Dotted config keys set by `pdserve up` flags (None = keep the file's value)."""
    from cliflags.model_flags import UNSET

    out: dict[str, Any] = {
        "model": args.model,
        "mode": args.mode,
        "workers.prefill": args.prefill,
        "workers.decode": args.decode,
        "workers.colocated": args.colocated,
        "router.port": args.port,
        "router.http_port": args.http_port,
        "router.host": args.host,
        "router.prefix_index.kind": "redis" if args.redis_url else None,
        "router.prefix_index.url": args.redis_url,
        "torch_threads": args.torch_threads,
        "ray.address": args.ray_address,
        "launcher": "process" if args.no_ray else None,
        **server_security_overrides(args),
    }
    if args.ray_address:  # a local cluster's size means nothing on an external one
        out["ray.num_cpus"] = UNSET
    unused = {"disagg": ("colocated",), "colocated": ("prefill", "decode")}.get(args.mode, ())
    for role in unused:
        if out[f"workers.{role}"] is None:
            out[f"workers.{role}"] = 0
    return out


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def up_main(args: argparse.Namespace) -> int:
    """Run `pdserve up`: 0 after a clean stop, 1 if the cluster failed to start, 2 for a bad
    config, 130 when interrupted while starting."""
    from deploy.config import load_cluster_config

    try:
        config = load_cluster_config(args.config, up_overrides(args))
    except (OSError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        print(f"pdserve up: bad config: {exc}", file=sys.stderr)
        return 2
    log.debug("effective config: %s", config.model_dump_json())
    try:
        secret = up_secret(config)
    except ValueError as exc:
        print(f"pdserve up: bad config: {exc}", file=sys.stderr)
        return 2
    # SIGTERM while starting unwinds like Ctrl-C, so the `finally` below stops what started.
    signal.signal(signal.SIGTERM, _raise_interrupt)
    workers: Workers | None = None
    try:
        try:
            workers = _launch_workers(config, args.log_dir, secret)
        except (RuntimeError, TimeoutError, ValueError) as exc:
            print(f"pdserve up: workers failed to start: {exc}", file=sys.stderr)
            return 1
        return asyncio.run(_serve_router(config, workers))
    except KeyboardInterrupt:
        print("pdserve up: interrupted", file=sys.stderr)
        return 130
    finally:
        if workers is not None:
            workers.stop()


def _say(event: SupervisionEvent) -> None:
    """Tell the operator (stderr) what needs them: a worker given up or stopped on request
    (it stays down), a role with no live worker left, a role back. Deaths and restarts are
    logged by the supervisor itself."""
    if event.kind in ("gave_up", "stopped", "role_down", "role_up"):
        what = event.kind.replace("_", " ")
        print(f"pdserve up: {event.worker_id}: {what}: {event.detail}", file=sys.stderr, flush=True)


def up_secret(config: ClusterConfig) -> ClusterSecret:
    """The cluster secret of `pdserve up`: `security.cluster_secret_file`, else
    PDSERVE_CLUSTER_SECRET (then removed from this process's environment, which Ray's and
    every other child's would inherit), else a fresh one."""
    from security.secret import ClusterSecret

    from_env = ClusterSecret.from_env(remove=True)
    if config.security.cluster_secret_file is not None:
        return ClusterSecret.from_file(config.security.cluster_secret_file)
    return from_env or ClusterSecret.generate()


def _launch_workers(config: ClusterConfig, log_dir: str | None, secret: ClusterSecret) -> Workers:
    """The workers of `config`, started by the launcher it names (`deploy.launchers`)."""
    from deploy.launchers import launcher_for

    logs = None if log_dir is None else Path(log_dir)
    return launcher_for(config).launch(config, log_dir=logs, on_event=_say, cluster_secret=secret)


async def _serve_router(config: ClusterConfig, workers: Workers) -> int:
    """Run the router in this process until SIGINT/SIGTERM; 1 if it never became healthy."""
    from router.app import has_usable_route, start_router

    rc = workers.router_config
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    handle = await start_router(rc, cluster_secret=workers.internal.secret)
    try:
        deadline = loop.time() + 30.0  # healthy = a usable route, what its health service says
        while not has_usable_route(rc.mode, handle.pool.views()):
            if loop.time() > deadline or stop.is_set():
                print("pdserve up: router never became healthy", file=sys.stderr)
                return 1
            await asyncio.sleep(0.1)
            await handle.pool.poll_once()
        roles = ", ".join(
            f"{len(a)} {role}: {' '.join(a)}" for role, a in workers.addresses().items() if a
        )
        http = f" http {handle.http.url}" if handle.http is not None else ""
        print(f"pdserve ready: {rc.host}:{handle.port} ({config.mode}, {roles}){http}", flush=True)
        await stop.wait()
        print("pdserve up: stopping", file=sys.stderr, flush=True)
        return 0
    finally:
        await handle.stop()


LOG_LEVEL_HELP = "logging level: DEBUG, INFO, WARNING, ... (default: INFO for `up`, else WARNING)"


def build_parser() -> argparse.ArgumentParser:
    """The `pdserve` parser: every subcommand, each option's help showing its default, and
    `--log-level` accepted before or after the subcommand."""
    parser = argparse.ArgumentParser(
        prog="pdserve", description="Disaggregated prefill/decode LLM serving."
    )
    parser.add_argument("--log-level", default=None, help=LOG_LEVEL_HELP)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_make_model_parser(sub)
    add_pull_parser(sub)
    add_convert_parser(sub)
    add_quantize_parser(sub)
    add_batch_parser(sub)
    add_goodput_demo_parser(sub)
    add_batch_demo_parser(sub)
    add_up_parser(sub)
    add_generate_parser(sub)
    add_bench_parser(sub)
    add_report_parser(sub)
    add_profile_parser(sub)
    add_plan_parser(sub)
    add_simulate_parser(sub)
    add_soak_parser(sub)
    for sp in sub.choices.values():
        # SUPPRESS: unless given here, the value before the subcommand (or None) stands.
        sp.add_argument("--log-level", default=argparse.SUPPRESS, help=LOG_LEVEL_HELP)
    use_defaults_help(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of `pdserve`; returns the exit code (argparse exits 2 on bad usage)."""
    args = build_parser().parse_args(argv)
    level = args.log_level or getattr(args, "default_log_level", "WARNING")
    logging.basicConfig(level=level.upper(), format="%(levelname)s %(name)s: %(message)s")
    if threading.current_thread() is not threading.main_thread():  # signals: main thread only
        return int(args.func(args))
    # SIGTERM unwinds every subcommand like Ctrl-C, so the clusters, redis-servers and load
    # generators it started are stopped by the same `finally` blocks (a bench killed by its
    # job runner left its clusters running); `up`'s router loop installs its own handlers.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return int(args.func(args))
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
