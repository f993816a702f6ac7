"""The goodput load generator and a whole `run_bench` against a router over fake workers.

Fake workers (tests/fakes) answer with configurable per-token delays, so these runs take
seconds. The load generator runs in its own process, as in a real benchmark; the fake cluster
runs either on the test's event loop or (for `run_bench`, which is synchronous) on a thread.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deploy.bench_cli import add_report_parser, report_main
from tests.fakes.cluster import fake_cluster
from tests.fakes.fake_worker import FakeWorkerConfig
from tooling.goodput.analysis import SLO, attainment
from tooling.goodput.bench import BenchConfig, run_bench
from tooling.goodput.loadgen import LoadJob, run_load, run_load_process_async
from tooling.goodput.records import TIMING_FIELDS
from tooling.goodput.workloads import make_requests

WORKER = FakeWorkerConfig(token_delay_s=0.004, prefill_delay_s=0.01, total_blocks=4096)


def test_loadgen_process_records_every_request(tiny_model_dir: Path, tmp_path: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, worker=WORKER) as c:
            specs = make_requests("chat", 40, 25.0, context=256, seed=1, output_len=12)
            job = LoadJob(c.router.address, specs, config="fake", rate=25.0, label="lg")
            run = await run_load_process_async(job, tmp_path)
            assert [r.index for r in run.records] == list(range(40))
            assert all(r.ok and r.num_tokens == 12 for r in run.records), run.records[0]
            assert all(r.finish_reason == "length" for r in run.records)
            r = run.records[0]
            assert r.ttft_ms is not None and r.ttft_ms > 0
            assert r.tpot_ms is not None and r.tpot_ms >= 3.0  # 4 ms per token, minus jitter
            assert len(r.itl_ms) == 11 and r.e2e_ms is not None and r.e2e_ms >= r.ttft_ms
            assert set(TIMING_FIELDS) <= set(r.server) and r.server["prefill_compute_ms"] == 1.0
            assert r.prefill_worker.startswith("fake-prefill")
            assert run.valid and run.send_lag_p99_ms <= 10.0, run.send_lag_p99_ms
            # arrivals honoured: sends follow the schedule within the lag
            assert all(abs(x.sent_s - x.scheduled_s) < 0.05 for x in run.records)
            assert run.duration_s >= specs[-1].arrival_s
            assert (tmp_path / "lg.result.json").is_file()

    asyncio.run(scenario())


def test_errors_are_recorded_and_count_as_misses(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, worker=WORKER, max_route_attempts=1) as c:
            c.decode[0].fail["Reserve"] = grpc.StatusCode.RESOURCE_EXHAUSTED
            specs = make_requests("chat", 6, 50.0, context=256, seed=2, output_len=4)
            run = await run_load(LoadJob(c.router.address, specs, label="err"), progress=False)
            assert {r.status for r in run.records} == {"RESOURCE_EXHAUSTED"}
            assert all(not r.ok and r.ttft_ms is None for r in run.records)
            a = attainment(run.records, SLO(1e9, 1e9))
            assert (a.both, a.errors) == (0.0, 6)

    asyncio.run(scenario())


def test_deadline_ends_a_stuck_request(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, worker=WORKER) as c:
            c.prefill[0].hang.add("Prefill")
            specs = make_requests("chat", 2, 50.0, context=256, seed=2, output_len=4)
            job = LoadJob(c.router.address, specs, timeout_s=0.5, label="dl")
            run = await run_load(job, progress=False)
            assert {r.status for r in run.records} == {"DEADLINE_EXCEEDED"}

    asyncio.run(scenario())


@pytest.fixture
def threaded_fake_cluster(tiny_model_dir: Path) -> Iterator[dict[str, str]]:
    """A fake cluster served from its own thread and event loop; yields its gRPC `address`
    and its HTTP front's OpenAI base URL (`url`)."""
    ready, stop = threading.Event(), threading.Event()
    box: dict[str, str] = {}

    async def serve() -> None:
        async with fake_cluster(tiny_model_dir, worker=WORKER, http_port=0) as c:
            box["address"] = c.router.address
            assert c.router.http is not None
            box["url"] = c.router.http.url
            ready.set()
            while not stop.is_set():
                await asyncio.sleep(0.02)

    thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(10.0), "fake cluster did not start"
    yield box
    stop.set()
    thread.join(10.0)


def test_run_bench_against_a_fake_cluster(
    threaded_fake_cluster: dict[str, str], tmp_path: Path
) -> None:
    out = tmp_path / "bench"
    cfg = BenchConfig(
        out=out, address=threaded_fake_cluster["address"], configs=("fake",), workload="chat",
        context=256, output_len=8, rates=(20.0, 40.0), duration_s=1.0, min_requests=20,
        ttft_slo_ms=5000.0, tpot_slo_ms=1000.0, bisect_steps=1, grid_above=1, repeats=2,
        warm_start=True,
    )  # fmt: skip
    # SLOs are loose on purpose: this test checks the search's mechanics (every rate passes, so
    # the sweep steps up once to the grid's ceiling; the second repeat starts there and tests
    # the rate below), not the fake cluster's speed on a loaded 2-core machine.
    summary = run_bench(cfg)
    data = json.loads((out / "results.json").read_text())
    assert data["meta"]["slo"] == {"ttft_ms": 5000.0, "tpot_ms": 1000.0}
    assert data["meta"]["calibration"]["decode_ms"] > 0
    assert data["meta"]["machine"]["matmul_gflops"] > 0
    assert [(r["seed"], r["rate"]) for r in data["runs"]] == [
        (0, 20.0), (0, 40.0), (0, 80.0), (1, 80.0), (1, 40.0)
    ]  # fmt: skip
    assert all(len(r["records"]) >= 20 and r["valid"] for r in data["runs"])
    assert data["meta"]["search"]["seeds"] == [0, 1]
    assert [m.rate for m in summary.max_goodput["fake"]] == [80.0, 80.0]
    assert all(m.lower_bound for m in summary.max_goodput["fake"])
    report = (out / "report.md").read_text()
    assert "max goodput" in report and "fake" in report and "GB/s" in report
    # A run's SLO goodput and a sweep's max goodput are named apart (report and JSON).
    assert "| SLO goodput |" in report and "| goodput |" not in report
    fake = json.loads((out / "summary.json").read_text())["series"]["fake"]
    assert fake["max_goodput_rps"] == 80.0 and fake["max_goodput_is_lower_bound"]
    first = fake["repeats"][0]["runs"]
    assert [r["offered_rate_rps"] for r in first] == [20.0, 40.0, 80.0]
    assert all(0 < r["slo_goodput_rps"] <= r["offered_rate_rps"] * 1.5 for r in first)
    for png in ("attainment.png", "latency_cdf.png", "ttft_breakdown.png"):
        assert (out / png).stat().st_size > 1000
    # `pdserve report` re-renders it, and compares two runs
    parser = __import__("argparse").ArgumentParser()
    add_report_parser(parser.add_subparsers())
    assert report_main(parser.parse_args(["report", str(out)])) == 0
    cmp = tmp_path / "cmp"
    assert report_main(parser.parse_args(["report", str(out), str(out), "--out", str(cmp)])) == 0
    assert "bench:fake" in (cmp / "report.md").read_text()


def test_openai_load_records_every_request_and_http_errors(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, worker=WORKER, http_port=0) as c:
            assert c.router.http is not None
            specs = make_requests("chat", 12, 25.0, context=256, seed=1, output_len=10)
            job = LoadJob(
                c.router.http.url, specs, label="oai", api="openai",
                model=tiny_model_dir.name, vocab_size=1024,
            )  # fmt: skip
            run = await run_load(job, progress=False)
            assert all(r.ok and r.num_tokens == 10 for r in run.records), run.records[0]
            r = run.records[0]
            assert r.finish_reason == "length" and r.request_id == "oai-0-0"
            assert r.ttft_ms is not None and r.tpot_ms is not None and r.tpot_ms >= 3.0
            assert r.e2e_ms is not None and r.e2e_ms >= r.ttft_ms and r.itl_ms
            assert r.server == {}  # an OpenAI server reports no timings
            assert {r.prefill_path for r in run.records} == {"remote"}  # pdserve's extension
            bad = LoadJob(c.router.http.url, specs[:2], api="openai", model="nope", vocab_size=1024)
            run = await run_load(bad, progress=False)
            assert {r.status for r in run.records} == {"HTTP_404"}
            assert "does not exist" in run.records[0].error

    asyncio.run(scenario())


def test_bench_puts_an_openai_server_beside_pdserve(
    threaded_fake_cluster: dict[str, str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`pdserve bench --addr A --openai-url U`: the same cluster through gRPC and through its
    own HTTP front, same workload and arrivals, interleaved, in one report."""
    from deploy.bench_cli import main as bench_cli_main

    out = tmp_path / "bench"
    argv = ["bench", "--addr", threaded_fake_cluster["address"], "--configs", "grpc"]
    argv += ["--openai-url", threaded_fake_cluster["url"], "--model", "missing-folder"]
    argv += ["--vocab-size", "1024", "--workload", "chat", "--context", "256"]
    argv += ["--output-len", "8", "--rates", "20", "--duration", "1", "--min-requests", "15"]
    argv += ["--ttft-slo-ms", "5000", "--tpot-slo-ms", "1000", "--bisect-steps", "0"]
    assert bench_cli_main([*argv, "--out", str(out)]) == 0
    data = json.loads((out / "results.json").read_text())
    configs = [r["config"] for r in data["runs"]]
    assert set(configs) == {"grpc", "openai"} and configs.count("grpc") == configs.count("openai")
    for run in data["runs"]:
        assert all(rec["status"] == "OK" and rec["num_tokens"] == 8 for rec in run["records"])
    assert data["meta"]["openai"]["model"] == tiny_model_dir.name
    report = (out / "report.md").read_text()
    assert "OpenAI-compatible server at" in report and "`grpc`" in report
