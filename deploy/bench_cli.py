"""`pdserve bench`, `pdserve report` and `pdserve demo` (the goodput demo). CLI process.

    pdserve bench [--configs colocated,colocated-nochunk,disagg | --addr HOST:PORT]
                  [--openai-url URL [--openai-model NAME] [--vocab-size N]]
                  [--workload summarize|chat|code|prefix|multiturn | --trace FILE]
                  [--prompts random|text]
                  [--rates 0.5,1,2] [--ttft-slo-ms MS --tpot-slo-ms MS | --ttft-scale X ...]
                  [--out DIR] ...
    pdserve report DIR [DIR ...] [--out DIR]
    pdserve demo [--model models/smollm2-135m-instruct] [--out runs/demo]
                 [--configs colocated,disagg] [--repeats 3]

Each prints the report's path, its headline and any non-monotone point on stdout (progress
goes to stderr) and exits 0;
2 for bad arguments, 1 when the benchmark failed. Heavy imports happen inside the subcommands.
`add_*_parser(subparsers)` registers a parser and sets `func` (see deploy/cli.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from deploy.cli_help import use_defaults_help
from security.cli import add_client_security_args, client_security


def _floats(value: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in value.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {value!r}"
        ) from None
    if not out:
        raise argparse.ArgumentTypeError("expected at least one number")
    return out


def _names(value: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in value.split(",") if x.strip())


def add_bench_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `bench`: max goodput of one or more configurations under SLOs."""
    from tooling.goodput.clusters import CONFIG_NAMES, DEFAULT_CONFIGS
    from tooling.goodput.workloads import WORKLOADS

    p = subparsers.add_parser(
        "bench",
        help="goodput benchmark: SLO attainment vs rate, max goodput, report",
        description="Start each configuration as a local cluster (or bench --addr), calibrate "
        "the unloaded prefill/decode times, search each configuration's max goodput on "
        "--repeats trace seeds (the highest tested rate meeting the target, with the rates "
        "around it tested; configurations interleaved) with a separate load-generator "
        "process, and write results.json + report.md (median and range over the repeats) + "
        "plots to --out.",
    )
    a = p.add_argument
    a("--model", default="models/small", help="model folder to serve")
    a("--addr", help="bench this running router instead of launching clusters (default: launch)")
    a("--openai-url", help="also bench this OpenAI-compatible server (http://host:port/v1) as "
      "configuration 'openai'; alone, bench only it (default: none)")  # fmt: skip
    a("--openai-model", help="model name at --openai-url (default: the server's first)")
    a("--vocab-size", type=int, help="vocabulary of --openai-url's token-id prompts "
      "(default: --model's)")  # fmt: skip
    a("--configs", type=_names, default=DEFAULT_CONFIGS, metavar="NAME[,NAME...]",
      help=f"configurations to launch, a comma list from {','.join(CONFIG_NAMES)} (default: "
      f"{','.join(DEFAULT_CONFIGS)})")  # fmt: skip
    a("--workload", choices=sorted(WORKLOADS), default="summarize",
      help="synthetic request lengths: chat (short in, medium out), summarize (long in, short "
      "out), code (medium in, short out), prefix / multiturn (shared prefixes)")  # fmt: skip
    a("--trace", help="replay a trace file, .csv/.jsonl (default: the --workload)")
    a("--prompts", choices=["random", "text"], default="random",
      help="prompt tokens: random ids, or windows of a built-in English corpus tokenized by "
      "--model's tokenizer; outputs keep their exact length either way (ignore_eos)")  # fmt: skip
    a("--context", type=int, help="length budget in tokens (default: the model's context)")
    a("--output-len", type=int, help="fixed output length (default: the workload's draw)")
    a("--arrival", choices=["poisson", "gamma"], default="poisson",
      help="inter-arrival times: poisson, or gamma (burstier, see --cv)")  # fmt: skip
    a("--cv", type=float, default=2.0, help="gamma arrivals' coefficient of variation")
    a("--seed", type=int, default=0, help="seed of lengths, tokens and arrivals")
    a("--rates", type=_floats, metavar="R[,R...]",
      help="listed rates in req/s, a comma list, e.g. 0.5,1,2 (default: --rel-rates)")  # fmt: skip
    a("--rel-rates", type=_floats, default=(0.25, 0.5, 0.75, 1.0), metavar="F[,F...]",
      help="listed rates as fractions of 1000/unloaded-prefill-ms, a comma list; used when "
      "--rates is not given")  # fmt: skip
    a("--grid-step", type=float, default=2.0,
      help="factor between grid rates beyond the listed ones")  # fmt: skip
    a("--grid-below", type=int, default=2,
      help="grid steps the search may take under the lowest listed rate")  # fmt: skip
    a("--grid-above", type=int, default=2,
      help="grid steps the search may take over the highest listed rate")  # fmt: skip
    a("--give-up", type=float, default=0.5,
      help="climbing through the listed rates stops at a rate below this attainment")  # fmt: skip
    a("--warm-start", action="store_true",
      help="each repeat after the first starts at the previous repeat's max goodput (a walk "
      "from one listed rate; default: every repeat starts at the lowest listed rate)")  # fmt: skip
    a("--repeats", type=int, default=3,
      help="trace seeds SEED .. SEED+N-1: each configuration's max goodput on each; the report "
      "gives the median and the range")  # fmt: skip
    a("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    a("--min-requests", type=int, default=40,
      help="fewest requests per run (40: one request moves attainment by 2.5 %%)")  # fmt: skip
    a("--ttft-slo-ms", type=float, help="TTFT SLO in ms (default: --ttft-scale x unloaded)")
    a("--tpot-slo-ms", type=float, help="TPOT SLO in ms (default: --tpot-scale x unloaded)")
    a("--ttft-scale", type=float, default=5.0,
      help="TTFT SLO = this x the unloaded TTFT, unless --ttft-slo-ms")  # fmt: skip
    a("--tpot-scale", type=float, default=5.0,
      help="TPOT SLO = this x the unloaded decode step, unless --tpot-slo-ms")  # fmt: skip
    a("--long-prompt-slo", metavar="N:TTFT_MS:TPOT_MS",
      help="judge prompts of >= N tokens by these SLOs instead, e.g. 300:6000:85 for "
      "summarization beside chat (default: one SLO for every request)")  # fmt: skip
    a("--target", type=float, default=0.9, help="attainment target: share meeting both SLOs")
    a("--bisect-steps", type=int, default=2,
      help="bisection steps between the last passing and first failing rate")  # fmt: skip
    a("--calibrate-on",
      help="configuration whose unloaded times set relative SLOs (default: the first)")  # fmt: skip
    a("--threads", type=int, default=2, help="total torch threads per configuration")
    a("--chunk-tokens", type=int, default=256, help="chunked-prefill step budget")
    a("--num-kv-blocks", type=int, default=1024, help="KV blocks per worker")
    a("--max-num-seqs", type=int, default=32, help="most requests running at once per worker")
    a("--device", default="cpu", help="workers' torch device (cuda on a GPU machine)")
    a("--request-timeout-s", type=float,
      help="deadline of each request (default: 5 x its SLO budget, at least 30 s)")  # fmt: skip
    a("--title", default="pdserve goodput benchmark", help="report title")
    a("--out", help="run folder (default: runs/bench-YYYYmmdd-HHMMSS)")
    add_client_security_args(p)  # for --addr
    p.set_defaults(func=bench_main)


def bench_config(args: argparse.Namespace) -> Any:
    """Namespace -> validated `BenchConfig` (raises ValueError / ValidationError)."""
    from tooling.goodput.bench import BenchConfig

    out = args.out or f"runs/bench-{time.strftime('%Y%m%d-%H%M%S')}"
    configs = args.configs
    if args.addr and configs == _default_configs():
        configs = ("external",)  # one running cluster; --configs NAME names it
    elif args.openai_url and configs == _default_configs():
        configs = ()  # the OpenAI server alone; --configs adds local pdserve clusters
    return BenchConfig(
        out=Path(out), model=Path(args.model), address=args.addr, configs=configs,
        openai_url=args.openai_url, openai_model=args.openai_model, vocab_size=args.vocab_size,
        workload=args.workload, trace=args.trace, prompts=args.prompts, context=args.context,
        output_len=args.output_len, arrival=args.arrival, cv=args.cv, seed=args.seed,
        rates=args.rates, rel_rates=args.rel_rates, grid_step=args.grid_step,
        grid_below=args.grid_below, grid_above=args.grid_above, give_up=args.give_up,
        warm_start=args.warm_start, repeats=args.repeats, duration_s=args.duration,
        min_requests=args.min_requests, ttft_slo_ms=args.ttft_slo_ms,
        tpot_slo_ms=args.tpot_slo_ms, ttft_scale=args.ttft_scale, tpot_scale=args.tpot_scale,
        long_prompt_slo=args.long_prompt_slo, target=args.target,
        bisect_steps=args.bisect_steps, calibrate_on=args.calibrate_on,
        threads=args.threads, chunk_tokens=args.chunk_tokens, num_kv_blocks=args.num_kv_blocks,
        max_num_seqs=args.max_num_seqs, device=args.device,
        request_timeout_s=args.request_timeout_s, title=args.title,
        client_security=client_security(args).to_json(),
    )  # fmt: skip


def _default_configs() -> tuple[str, ...]:
    from tooling.goodput.clusters import DEFAULT_CONFIGS

    return DEFAULT_CONFIGS


def _run(prog: str, cfg: Any) -> int:
    from deploy.tool_launchers import launch_cluster
    from tooling.goodput.bench import run_bench

    try:
        summary = run_bench(cfg, launch=launch_cluster)
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"pdserve {prog}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # clusters were stopped on the way out; results.json is kept
        print(f"pdserve {prog}: interrupted; runs so far in {cfg.out}/results.json",
              file=sys.stderr)  # fmt: skip
        return 130
    print_summary(summary)
    return 0


def print_summary(summary: Any) -> None:
    """The report's path, the headline and each non-monotone point (stdout)."""
    print(f"report: {summary.report}")
    print(summary.headline)
    for warning in summary.warnings:
        print(f"warning: {warning}")


def bench_main(args: argparse.Namespace) -> int:
    try:
        cfg = bench_config(args)
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"pdserve bench: {exc}", file=sys.stderr)
        return 2
    if cfg.address is None and cfg.configs and not (cfg.model / "config.json").is_file():
        print(f"pdserve bench: --model {cfg.model} is not a model folder", file=sys.stderr)
        return 2
    if cfg.prompts == "text" and not (cfg.model / "tokenizer.json").is_file():
        print(f"pdserve bench: --prompts text needs --model's tokenizer: no "
              f"{cfg.model / 'tokenizer.json'}", file=sys.stderr)  # fmt: skip
        return 2
    return _run("bench", cfg)


def add_report_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `report`: render one saved run, or compare several."""
    p = subparsers.add_parser(
        "report",
        help="render or compare saved `pdserve bench` runs",
        description="With one DIR and no --out, re-render DIR/report.md and its plots from "
        "DIR/results.json. With several DIRs (or --out), write a side-by-side comparison.",
    )
    p.add_argument("dirs", nargs="+", metavar="DIR", help="run folders (with results.json)")
    p.add_argument("--out", help="comparison folder (default: runs/report-compare-YYYYmmdd-HHMMSS)")
    p.set_defaults(func=report_main)


def report_main(args: argparse.Namespace) -> int:
    from tooling.goodput.report import write_comparison, write_report

    try:
        if len(args.dirs) == 1 and not args.out:
            summary = write_report(args.dirs[0])
        else:
            out = args.out or f"runs/report-compare-{time.strftime('%Y%m%d-%H%M%S')}"
            summary = write_comparison(args.dirs, out)
    except (ValueError, KeyError, OSError) as exc:
        print(f"pdserve report: {exc!r}", file=sys.stderr)
        return 2
    print_summary(summary)
    return 0


def add_goodput_demo_parser(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Register `demo`: one chat exchange, then the disaggregated-vs-colocated goodput
    comparison, on SmolLM2-135M-Instruct (`tooling.goodput.demo`)."""
    p = subparsers.add_parser(
        "demo",
        help="SmolLM2-135M-Instruct: one chat over the 1P1D cluster, then disaggregated vs "
        "colocated goodput",
        description="Pull and convert SmolLM2-135M-Instruct into --model unless a model is "
        "there (idempotent), start colocated (chunked prefill, 2 threads) and disaggregated "
        "1P+1D (1 thread each), ask the disaggregated cluster one question over the OpenAI "
        "chat API, then search each one's max goodput on 3 trace seeds (summarize-style "
        "real-text prompts, outputs fixed at 24 tokens with ignore_eos, TPOT-tight SLO, 40 "
        "requests per run), configurations interleaved; write the report and print the "
        "headline: each max goodput and disagg/colocated, medians and ranges (~15 min on 2 "
        "cores).",
    )
    p.add_argument("--model", default="models/smollm2-135m-instruct", help="model folder")
    p.add_argument("--out", default="runs/demo", help="run folder")
    p.add_argument("--seed", type=int, default=0, help="seed of lengths, tokens and arrivals")
    p.add_argument("--configs", type=_names, metavar="NAME[,NAME...]",
                   help="configurations, a comma list (default: colocated,disagg; "
                   "colocated-nochunk and hybrid add about a third to the time each)")  # fmt: skip
    p.add_argument("--repeats", type=int,
                   help="trace seeds (default: 3; fewer: a rougher smoke run)")  # fmt: skip
    p.set_defaults(func=demo_main)


def demo_main(args: argparse.Namespace) -> int:
    from deploy.tool_launchers import launch_cluster
    from tooling.goodput.demo import DEMO, DEMO_CONFIGS, ensure_model, run_demo
    from tooling.models.pull import PullError

    t0 = time.monotonic()
    try:
        model = ensure_model(Path(args.model))
    except PullError as exc:
        print(f"pdserve demo: {exc}", file=sys.stderr)
        return 1
    try:
        summary = run_demo(
            model, Path(args.out), args.seed, launch_cluster, args.configs or DEMO_CONFIGS,
            repeats=args.repeats or DEMO["repeats"],
        )  # fmt: skip
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"pdserve demo: {exc}", file=sys.stderr)
        return 2
    except (RuntimeError, TimeoutError, OSError) as exc:
        print(f"pdserve demo: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # clusters were stopped on the way out; results.json is kept
        print(f"pdserve demo: interrupted; runs so far in {args.out}/results.json",
              file=sys.stderr)  # fmt: skip
        return 130
    print_summary(summary)
    print(f"demo took {time.monotonic() - t0:.0f} s", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m deploy.bench_cli bench|report|demo ...` (the same as `pdserve ...`)."""
    parser = argparse.ArgumentParser(prog="python -m deploy.bench_cli")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_bench_parser(sub)
    add_report_parser(sub)
    add_goodput_demo_parser(sub)
    use_defaults_help(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
