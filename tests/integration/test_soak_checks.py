"""The soak's judge against the real reference engine on the tiny model: it must call a wrong
token wrong, a clean stream exact, a partial stream that ended with a clear status fine, and
everything else what it is; and the injector's SIGSTOP / SIGCONT bookkeeping on a real child
process. Runs in the pytest process (torch, no cluster)."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.tool_launchers import launch_workers
from proto.pdserve.v1 import inference_pb2
from tooling.redis_server import SKIP_REASON, redis_server_path
from tooling.soak.check import judge
from tooling.soak.client import Outcome, longest_wait
from tooling.soak.cluster import SoakCluster, process_start_time
from tooling.soak.config import SoakConfig
from tooling.soak.reference import Reference
from tooling.soak.workload import PlannedRequest, f32

GREEDY = PlannedRequest(0, 0.0, "greedy", tuple(range(10, 50)), max_tokens=12, ignore_eos=True)
SAMPLED = replace(GREEDY, index=1, kind="sampled", temperature=f32(0.9), top_k=40, seed=99)


@pytest.fixture(scope="module")
def ref(tiny_model_dir: Path) -> Reference:
    r = Reference(tiny_model_dir)
    r.run([GREEDY, SAMPLED])
    return r


def outcome(r: PlannedRequest, ref: Reference, **kw: object) -> Outcome:
    want = ref.expected(r)
    base = Outcome(r.index, 0.0, 30.0, 1.0, "OK", "", list(want.tokens), want.text,
                   want.finish_reason)  # fmt: skip
    return replace(base, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("r", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_judge(ref: Reference, r: PlannedRequest) -> None:
    want = list(ref.expected(r).tokens)
    assert len(want) == 12

    def verdict(**kw: object) -> str:
        return judge(r, outcome(r, ref, **kw), ref.expected(r), ref, 2.0).category

    assert verdict() == "exact"
    wrong = want[:5] + [(want[5] + 7) % 1000 + 4] + want[6:]
    assert verdict(tokens=wrong) == "wrong"
    assert verdict(tokens=want[:7]) == "wrong"  # OK but tokens lost
    assert verdict(tokens=want + [5]) == "wrong"
    assert verdict(finish_reason="stop") == "wrong"
    assert verdict(text="something else") == "wrong"
    assert verdict(code="UNAVAILABLE", tokens=want[:4]) == "status"
    assert verdict(code="DEADLINE_EXCEEDED", tokens=[]) == "status"
    assert verdict(code="UNAVAILABLE", tokens=wrong[:7]) == "wrong"
    assert verdict(code="CANCELLED", client_cancelled=True, tokens=want[:3]) == "status"
    assert verdict(code="CANCELLED", tokens=want[:3]) == "unclear"  # nobody asked for it
    assert verdict(code="INTERNAL", tokens=[]) == "unclear"
    assert verdict(code="HUNG", hung=True) == "hung"
    assert verdict(ended_at=33.5) == "hung"  # OK, but 3.5 s after a 30 s deadline


@pytest.mark.parametrize("r", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_a_request_that_waited_past_the_stall_budget_is_stalled(
    ref: Reference, r: PlannedRequest
) -> None:
    """Right tokens are not enough: a request that sat on a frozen worker (waited on the
    cluster longer than the stall budget beyond its own work) fails the soak, whether it then
    completed or ended with a status; one the client cancelled, or with its own deadline, is
    not held to it."""
    want = list(ref.expected(r).tokens)

    def verdict(req: PlannedRequest = r, **kw: object) -> str:
        return judge(req, outcome(req, ref, **kw), ref.expected(req), ref, 2.0, 6.0).category

    assert verdict(waited_s=5.9) == "exact"
    assert verdict(waited_s=6.5) == "stalled"
    assert verdict(code="DEADLINE_EXCEEDED", tokens=[], waited_s=30.0) == "stalled"
    assert verdict(code="UNAVAILABLE", tokens=want[:3], waited_s=9.0) == "stalled"
    assert verdict(code="UNAVAILABLE", tokens=want[:3], waited_s=1.0) == "status"
    cancelled = {"code": "CANCELLED", "client_cancelled": True, "tokens": want[:3]}
    assert verdict(waited_s=9.0, **cancelled) == "status"
    assert verdict(replace(r, timeout_s=1.5), waited_s=9.0) == "exact"
    assert verdict(tokens=want[:5] + [3] + want[6:], waited_s=9.0) == "wrong"  # wrong first


def test_longest_wait_subtracts_the_work_the_router_measured() -> None:
    """Silences between sending, each token and the end; the first less the router's queue,
    the prefill and the KV transfer, the second less the decode admission and first step."""
    timings = inference_pb2.Timings(
        router_queue_ms=500, prefill_queue_ms=250, prefill_compute_ms=200, kv_transfer_ms=50,
        decode_admission_ms=300, first_decode_step_ms=100,
    )  # fmt: skip
    assert longest_wait(0.0, [2.0, 2.5, 2.6], 2.7) == pytest.approx(2.0)
    assert longest_wait(0.0, [2.0, 2.5, 2.6], 2.7, timings) == pytest.approx(1.0)
    assert longest_wait(0.0, [1.0, 2.3, 2.4], 2.5, timings) == pytest.approx(0.9)
    assert longest_wait(0.0, [0.5, 9.5], 9.6, timings) == pytest.approx(8.6)  # a stuck stream
    assert longest_wait(0.0, [], 30.0) == pytest.approx(30.0)  # nothing came: all of it


def test_stop_strings_cut_expected_tokens_like_the_router(ref: Reference) -> None:
    full = ref.expected(GREEDY)
    stop = full.full_text[len(full.full_text) // 2 :][:3]
    cut = ref.expected(replace(GREEDY, stop=(stop,)))
    assert cut.finish_reason == "stop" and stop not in cut.text
    assert cut.tokens == full.tokens[: len(cut.tokens)] and len(cut.tokens) < len(full.tokens)
    assert full.full_text.startswith(cut.text)


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def _wait_state(pid: int, ok: Callable[[str], bool], what: str, timeout_s: float = 30.0) -> None:
    """Poll the process's state letter until `ok` (a signal takes effect when it is next run)."""
    deadline = time.monotonic() + timeout_s
    while not ok(state := _state(pid)):
        assert time.monotonic() < deadline, f"pid {pid} never {what} (state {state})"
        time.sleep(0.01)


def test_the_injector_resumes_only_a_process_it_stopped(tmp_path: Path) -> None:
    """SIGSTOP / SIGCONT go by pid and process start time: a stopped process is resumed once;
    one that died meanwhile (its pid possibly reused) gets no SIGCONT."""
    if redis_server_path() is None:
        pytest.skip(SKIP_REASON)
    cluster = SoakCluster(SoakConfig(model=tmp_path, out=tmp_path), launch_workers)
    proc = subprocess.Popen(["sleep", "30"])
    try:
        assert cluster.send_signal(proc.pid, signal.SIGSTOP)
        _wait_state(proc.pid, lambda s: s == "T", "stopped")
        assert cluster.resume(proc.pid)
        _wait_state(proc.pid, lambda s: s != "T", "resumed")
        assert not cluster.resume(proc.pid)  # not stopped by the soak any more
        assert cluster.send_signal(proc.pid, signal.SIGSTOP)
    finally:
        proc.kill()
        proc.wait()
    assert process_start_time(proc.pid) is None
    assert not cluster.resume(proc.pid) and not cluster.stopped
    assert not cluster.send_signal(proc.pid, signal.SIGSTOP)
