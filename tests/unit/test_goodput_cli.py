"""`pdserve bench / report / demo` argument handling (no clusters started)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deploy.bench_cli import (
    add_bench_parser,
    add_goodput_demo_parser,
    add_report_parser,
    bench_config,
    main,
)
from deploy.config import load_cluster_config
from tooling.goodput.clusters import CONFIG_NAMES, EngineSizing, cluster_settings
from tooling.goodput.demo import demo_config


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    add_bench_parser(sub)
    add_report_parser(sub)
    add_goodput_demo_parser(sub)
    return parser.parse_args(argv)


def test_bench_flags_become_a_config(tmp_path: Path) -> None:
    args = parse(["bench", "--configs", "colocated,disagg", "--rates", "0.5,1", "--out",
                  str(tmp_path), "--ttft-slo-ms", "900", "--tpot-slo-ms", "80"])  # fmt: skip
    cfg = bench_config(args)
    assert cfg.configs == ("colocated", "disagg") and cfg.rates == (0.5, 1.0)
    assert (cfg.ttft_slo_ms, cfg.tpot_slo_ms, cfg.out) == (900.0, 80.0, tmp_path)
    assert cfg.workload == "summarize" and cfg.target == 0.9
    assert cfg.long_prompt_slo is None
    assert (cfg.repeats, cfg.min_requests, cfg.warm_start) == (3, 40, False)  # the defaults
    args = parse(["bench", "--rel-rates", "0.5", "--grid-step", "1.26", "--grid-below", "3",
                  "--grid-above", "9", "--warm-start", "--repeats", "5", "--give-up", "0.9",
                  "--out", str(tmp_path)])  # fmt: skip
    cfg = bench_config(args)
    assert (cfg.rel_rates, cfg.grid_step, cfg.grid_below, cfg.grid_above) == ((0.5,), 1.26, 3, 9)
    assert (cfg.warm_start, cfg.repeats, cfg.give_up) == (True, 5, 0.9)
    args = parse(["bench", "--ttft-slo-ms", "300", "--tpot-slo-ms", "240", "--long-prompt-slo",
                  "307:6000:85", "--out", str(tmp_path)])  # fmt: skip
    assert bench_config(args).long_prompt_slo == "307:6000:85"


def test_bench_against_an_address_names_it_external() -> None:
    cfg = bench_config(parse(["bench", "--addr", "127.0.0.1:50051"]))
    assert cfg.address == "127.0.0.1:50051" and cfg.configs == ("external",)
    cfg = bench_config(parse(["bench", "--addr", "h:1", "--configs", "gpu-2p2d"]))
    assert cfg.configs == ("gpu-2p2d",)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["bench", "--configs", "colocated,fancy"], "configs"),
        (["bench", "--calibrate-on", "disagg", "--configs", "colocated"], "calibrate_on"),
        (["bench", "--model", "/nonexistent/model"], "not a model folder"),
        (["bench", "--long-prompt-slo", "307:6000"], "MIN_PROMPT_TOKENS:TTFT_MS:TPOT_MS"),
        (["bench", "--repeats", "0"], "repeats"),
        (["bench", "--grid-step", "1"], "grid_step"),
    ],
)
def test_bad_bench_arguments_exit_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_bad_rates_are_rejected_by_argparse() -> None:
    with pytest.raises(SystemExit):
        parse(["bench", "--rates", "fast"])


def test_report_of_a_folder_without_results(tmp_path: Path) -> None:
    assert main(["report", str(tmp_path)]) == 2


def test_demo_config_is_valid(tmp_path: Path) -> None:
    cfg = demo_config(Path("models/smollm2-135m-instruct"), tmp_path)
    assert cfg.configs == ("colocated", "disagg") and cfg.calibrate_on in cfg.configs
    assert cfg.prompts == "text" and cfg.http_front
    # issue 42: points that resolve 90 %, three seeds, a walk that re-brackets per repeat
    assert cfg.min_requests >= 40 and cfg.repeats >= 3 and cfg.warm_start
    assert len(cfg.rel_rates) == 1 and cfg.grid_step < 1.3
    every = demo_config(Path("m"), tmp_path, configs=CONFIG_NAMES, repeats=1)
    assert every.configs == CONFIG_NAMES and every.repeats == 1


def test_demo_flags() -> None:
    args = parse(["demo", "--configs", "colocated,hybrid", "--repeats", "1"])
    assert args.configs == ("colocated", "hybrid") and args.repeats == 1
    args = parse(["demo"])
    assert args.configs is None and args.repeats is None  # DEMO's, resolved in demo_main


@pytest.mark.parametrize("name", CONFIG_NAMES)
def test_compared_configurations_use_the_same_threads(name: str) -> None:
    sizing = EngineSizing(context=512, chunk_tokens=128)
    cc = load_cluster_config(None, cluster_settings(name, Path("models/small"), sizing))
    threads = cc.torch_threads * cc.num_workers
    assert threads == 2 and cc.launcher == "process"
    assert cc.engine.enable_chunked_prefill == (name != "colocated-nochunk")
    spec = cc.engine.speculative
    assert (spec is not None and spec.method == "ngram") == name.endswith("-spec")
    if name == "colocated-nochunk":
        assert cc.engine.max_num_batched_tokens >= 512
    else:
        assert cc.engine.max_num_batched_tokens == 128


def test_pdserve_demo_is_the_goodput_demo() -> None:
    """`pdserve demo` (the README's main command) runs the goodput comparison; the engine-only
    batch demo moved to `batch-demo`."""
    from deploy import bench_cli, cli

    parser = cli.build_parser()
    assert parser.parse_args(["demo"]).func is bench_cli.demo_main
    assert parser.parse_args(["batch-demo"]).func is cli.batch_demo_main
