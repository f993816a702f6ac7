"""Isolation between clients (issue 26): one client's deadline ends only its own request.

A deadline storm — 10 `Generate` calls with deadlines of 5, 15, ..., 95 ms, which end while
their KV is moving — beside 10 normal calls on the same prefill-decode pairs loses none of the
normal calls, never gets a decode worker marked unhealthy or a KV pair dropped, and every
worker's free KV blocks come back to their start values. On 1P1D and 1P2D (real router and
worker processes, no Ray).

Runs in the pytest process; one cluster per topology, stopped by PID at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from deploy.client import build_request
from tests.e2e.helpers import E2ECluster

pytestmark = pytest.mark.slow
NORMAL = build_request(
    prompt="The river flows " * 30, max_tokens=100, ignore_eos=True, temperature=0.0
)
STORM_DEADLINES_S = [(5 + 10 * i) / 1000 for i in range(10)]
STORMS = 3  # the unfixed code lost normal calls in 1 to 3 storms of 3 (1P1D), every one (1P2D)


@pytest.fixture(scope="module", params=[1, 2], ids=["1p1d", "1p2d"])
def cluster(
    request: pytest.FixtureRequest, start_cluster: Callable[..., Iterator[E2ECluster]]
) -> Iterator[E2ECluster]:
    yield from start_cluster(
        f"isolation-{request.param}", "disagg", prefill=1, decode=int(request.param)
    )


def _call(cluster: E2ECluster, timeout_s: float) -> tuple[str, list[int]]:
    """(status code name, tokens) of one call."""
    tokens: list[int] = []
    try:
        for resp in cluster.stub.Generate(NORMAL, timeout=timeout_s):
            tokens += resp.token_ids
    except grpc.RpcError as exc:
        return exc.code().name, tokens  # type: ignore[attr-defined]
    return "OK", tokens


def _log_lines(cluster: E2ECluster, pattern: str, needle: str) -> list[str]:
    logs = sorted(cluster.local.workers.log_dir.glob(pattern))
    return [
        line for log in logs for line in log.read_text(errors="replace").splitlines()
        if needle in line
    ]  # fmt: skip


def test_a_deadline_storm_loses_no_normal_request(cluster: E2ECluster) -> None:
    want = _call(cluster, 60.0)  # undisturbed
    assert want[0] == "OK" and len(want[1]) == 100, want
    for storm in range(STORMS):
        timeouts = [60.0] * 10 + STORM_DEADLINES_S
        with ThreadPoolExecutor(len(timeouts)) as pool:
            got = list(pool.map(lambda t: _call(cluster, t), timeouts))
        normal, storm_calls = got[:10], got[10:]
        lost = [(code, len(toks)) for code, toks in normal if (code, toks) != want]
        assert not lost, f"storm {storm}: normal calls lost or changed: {lost}"
        # The storm's own calls end by their deadline (a call that beat it is fine too).
        assert {code for code, _ in storm_calls} <= {"DEADLINE_EXCEEDED", "OK"}, storm_calls
        assert not _log_lines(cluster, "router*.log", "marked unhealthy")
        # No KV pair was torn down: a request's deadline ends only its own transfer.
        assert not _log_lines(cluster, "worker-*.log", "dropping pair")
        cluster.wait_no_leaks(15.0)
