"""Conditional disaggregation through a real hybrid 1P+2D cluster (issue 31): the local path.

`[router.hybrid]` local_prefill_max_tokens = `LOCAL`, no spill: the 40-token `PROMPT` is
prefilled on its decode worker (Generate), `LONG` (200 tokens) on the prefill worker. Checked
on the local path, with the patterns of test_migration.py (victims picked by the worker's own
status, never by the client's reading speed):

- both paths in one cluster, greedy tokens equal to the colocated engine's, counted in
  `pdserve:prefill_path_total{path,reason}` on the router's /metrics;
- a client that cancels a local stream mid-way: its decode worker gets the Abort, every block
  comes back;
- a SIGKILLed decode worker mid-stream: the request migrates (prompt + tokens so far prefilled
  again elsewhere) and the client's greedy stream equals an undisturbed run;
- a SIGTERM drain: the local request finishes on its draining worker, nothing is moved; when
  the drain times out it is moved, and new local work goes to the other decode worker.

Every test ends with every live worker's free blocks back at their start values.
Runs in the pytest process; one cluster for the module, stopped by PID at the end.
"""

from __future__ import annotations

import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2
from prometheus_client.parser import text_string_to_metric_families

import tests.e2e.test_migration as migration
from deploy.client import build_request
from deploy.launcher import LaunchedWorker
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from tests.e2e.helpers import ENGINE, TIE_TOL, E2ECluster, Reference, wait_until

pytestmark = pytest.mark.slow
LOCAL = 64
PROMPT = migration.PROMPT  # 40 tokens: local
LONG = [(i * 31) % 1000 + 4 for i in range(200)]  # remote


@pytest.fixture(scope="module")
def cluster(
    start_cluster: Callable[..., Iterator[E2ECluster]], hold_dir: Path
) -> Iterator[E2ECluster]:
    """`hold_dir`: the workers' step gates (`worker.step_gate`), set before they start."""
    overrides: dict[str, object] = {
        "drain_timeout_s": migration.DRAIN_S,
        "supervision.backoff_s": 0.1,
        "router.stall_timeout_s": migration.STALL_S,
        "router.http_port": 0,
        "router.hybrid.local_prefill_max_tokens": LOCAL,
        # the path by the threshold alone: a short prompt stays local even when the polled
        # status still shows an earlier test's request decoding (the spill rule has its own
        # tests, on fake workers)
        "router.hybrid.spill_to_prefill": False,
    }
    yield from start_cluster("hybrid", "disagg", overrides, prefill=1, decode=2)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> LLMEngine:
    cfg = EngineConfig(**{**ENGINE, "enable_prefix_caching": False})  # type: ignore[arg-type]
    return LLMEngine.from_model_dir(tiny_model_dir, cfg)


def greedy(engine: LLMEngine, prompt: list[int], n: int) -> list[int]:
    (out,) = engine.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True))
    return list(out.output_token_ids)


def paths(cluster: E2ECluster) -> dict[tuple[str, str], float]:
    """`pdserve:prefill_path_total` by (path, reason), scraped from the router."""
    url = (cluster.local.http_url or "").removesuffix("/v1") + "/metrics"
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.labels["path"], s.labels["reason"]): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "pdserve:prefill_path_total"
    }


def test_both_paths_in_one_cluster_with_greedy_fidelity(
    cluster: E2ECluster, engine: LLMEngine
) -> None:
    before = paths(cluster)
    results = {}
    for name, prompt in (("short", PROMPT), ("long", LONG)):
        req = build_request(token_ids=prompt, max_tokens=16, temperature=0.0, ignore_eos=True)
        tokens, final = cluster.generate(req)
        assert tokens == greedy(engine, prompt, 16), name
        results[name] = final
    short, long = results["short"], results["long"]
    assert (short.prefill_path, short.prefill_path_reason) == ("local", "short_prompt")
    assert short.prefill_worker == short.decode_worker  # prefilled where it decoded
    assert short.timings.kv_transfer_ms == 0 and short.timings.prefill_compute_ms > 0
    assert (long.prefill_path, long.prefill_path_reason) == ("remote", "long_prompt")
    assert long.prefill_worker.startswith("prefill") and long.decode_worker.startswith("decode")
    after = paths(cluster)
    for key in (("local", "short_prompt"), ("remote", "long_prompt")):
        assert after[key] == before[key] + 1, (key, before, after)
    cluster.wait_no_leaks()


def test_cancelling_a_local_stream_frees_the_decode_worker(cluster: E2ECluster) -> None:
    before = paths(cluster)[("local", "short_prompt")]
    decoders = [w for w in cluster.local.workers.workers if w.role == "decode"]
    req = build_request(token_ids=PROMPT, max_tokens=900, temperature=0.0, ignore_eos=True)
    call = cluster.stub.Generate(req, timeout=60.0)
    got = 0
    for resp in call:  # 1. tokens are flowing: the decode worker runs it
        got += len(resp.token_ids)
        if got >= 3:
            break
    assert any(cluster.status(w.address).num_running > 0 for w in decoders)
    call.cancel()  # 2. the client goes away mid-stream
    with pytest.raises(grpc.RpcError):
        next(call)
    wait_until(  # 3. the router recorded it, on the local path
        lambda: paths(cluster)[("local", "short_prompt")] == before + 1,
        10.0,
        "the cancelled request to be counted",
    )
    cluster.wait_no_leaks(30.0)  # 4. the Abort freed every block on its decode worker
    assert all(cluster.status(w.address).num_running == 0 for w in decoders)


def test_a_local_stream_survives_its_decode_worker(
    cluster: E2ECluster, engine: LLMEngine, reference: Reference, hold_dir: Path
) -> None:
    n = migration.N
    req = build_request(token_ids=PROMPT, max_tokens=n, temperature=0.0, ignore_eos=True)
    tokens, final = migration._signal_decoder_mid_stream(cluster, req, 8, hold_dir)
    assert final.prefill_path == "local" and final.migrations == 1
    assert final.usage.completion_tokens == n
    expected = greedy(engine, PROMPT, n)
    if tokens != expected:  # allowed only at a float32 near-tie, as in the fidelity tests
        i = next(k for k, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        gap = reference.logit_gap(PROMPT + expected[:i], tokens[i])
        assert gap <= TIE_TOL, f"token {i}: got {tokens[i]}, want {expected[i]}"


def test_sigterm_lets_a_local_request_finish_on_its_draining_worker(
    cluster: E2ECluster, hold_dir: Path
) -> None:
    n = 24  # held after 4 steps, SIGTERMed, let go: the other 20 well within the 6 s drain
    req = build_request(token_ids=PROMPT, max_tokens=n, temperature=0.0, ignore_eos=True)
    tokens, final = migration._signal_decoder_mid_stream(
        cluster, req, 4, hold_dir, sig=signal.SIGTERM
    )
    assert len(tokens) == n and final.migrations == 0 and final.finish_reason == "length"
    assert final.prefill_path == "local"
    stops = [e for e in cluster.local.workers.events if e.kind == "stopped"]
    assert "exited with status 0" in stops[-1].detail, stops[-1]


def test_a_drain_timeout_moves_a_local_request_and_refuses_new_local_work(
    cluster: E2ECluster, hold_dir: Path
) -> None:
    seen: dict[str, str] = {}

    def while_draining(victim: LaunchedWorker) -> None:
        deadline = time.monotonic() + 10.0
        while migration._health(victim.address) != health_pb2.HealthCheckResponse.NOT_SERVING:
            assert time.monotonic() < deadline, "still serving after SIGTERM"
            time.sleep(0.005)
        short = build_request(token_ids=PROMPT[:9], max_tokens=4, temperature=0.0)
        _, info = cluster.generate(short)  # local work goes to the other decode worker
        seen["new_on"], seen["new_path"] = info.decode_worker, info.prefill_path
        status = cluster.status(victim.address)
        assert status.draining and status.num_running > 0, status
        # The victim stays held (`worker.step_gate`) until its drain times out: the request
        # outlasts the drain on any machine.
        seen["victim"] = victim.worker_id

    req = build_request(token_ids=PROMPT, max_tokens=migration.N, temperature=0.0, ignore_eos=True)
    tokens, final = migration._signal_decoder_mid_stream(
        cluster, req, 4, hold_dir, sig=signal.SIGTERM, while_draining=while_draining
    )
    assert seen["new_path"] == "local" and seen["new_on"] != seen["victim"]
    assert len(tokens) == migration.N and final.migrations == 1  # cut at the drain timeout
    assert final.prefill_path == "local"  # the first leg's path
