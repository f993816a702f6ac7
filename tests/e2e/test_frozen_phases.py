"""A real decode worker process stopped (SIGSTOP) before a request's first token, through a
real 1P+2D cluster (issue 39): the request moves to the other decode worker within the stall
timeout, at the phase it was in — its `Reserve` on the stopped worker, or the prefill worker's
KV push into it — never waiting out its deadline.

How each phase is reached, by state and never by timing: the router routes round-robin (two
requests sent together land one on each decode worker) and counts no poll timeout against a
worker's health (`status_poll_misses` 1000), so it keeps routing to the stopped worker until a
request's freeze watch judges it (`router.freeze_watch`). For the push, the prefill worker is
stopped first, the requests reserve on both decode workers (seen in their status), then one
decode worker is stopped and the prefill worker continued: it pushes into a stopped worker.
A request that waited on the stopped worker would fail DEADLINE_EXCEEDED at 30 s; the stall
timeout is 3 s. After SIGCONT every worker's blocks come back.

Runs in the pytest process; one cluster for the module, stopped by PID at the end.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from deploy.client import build_request
from deploy.launcher import LaunchedWorker
from proto.pdserve.v1 import inference_pb2
from tests.e2e.helpers import PROMPTS, E2ECluster, Reference, wait_until

pytestmark = pytest.mark.slow
DEADLINE_S = 30.0
CASES = ["len33", "len64"]


@pytest.fixture(scope="module")
def cluster(start_cluster: Callable[..., Iterator[E2ECluster]]) -> Iterator[E2ECluster]:
    overrides: dict[str, object] = {
        "router.policy": "round_robin",
        "router.status_poll_misses": 1000,  # only a freeze watch's probe marks a worker down
        "router.stall_timeout_s": 3.0,
        "router.default_timeout_s": DEADLINE_S,
        "router.abort_timeout_s": 60.0,  # the Abort to the stopped worker lands after SIGCONT
    }
    yield from start_cluster("frozen-phases", "disagg", overrides, prefill=1, decode=2)


def _role(cluster: E2ECluster, role: str) -> list[LaunchedWorker]:
    return [w for w in cluster.local.workers.workers if w.role == role]


def _router_uses_both_decoders(cluster: E2ECluster) -> None:
    """Readiness: short requests until each decode worker served one (the router hears from a
    continued worker at its next poll), then both idle."""
    decoders = _role(cluster, "decode")
    ids = {cluster.status(w.address).worker_id for w in decoders}
    req = build_request(token_ids=[5, 6, 7, 8], max_tokens=2, temperature=0.0)
    seen: set[str] = set()
    deadline = time.monotonic() + DEADLINE_S
    while seen != ids:
        assert time.monotonic() < deadline, f"the router used only {seen} of {ids}"
        with ThreadPoolExecutor(2) as pool:
            seen |= {info.decode_worker for _, info in pool.map(cluster.generate, [req] * 2)}
    wait_until(
        lambda: all(cluster.status(w.address).num_running == 0 for w in decoders),
        DEADLINE_S,
        "the decode workers to be idle",
    )


def _send_both(cluster: E2ECluster) -> list[tuple[list[int], inference_pb2.FinalInfo]]:
    """The two cases sent together (round-robin: one on each decode worker)."""
    prompts = {p.name: p for p in PROMPTS}
    with ThreadPoolExecutor(len(CASES)) as pool:
        futures = [
            pool.submit(cluster.generate, prompts[name].request(), DEADLINE_S) for name in CASES
        ]
        return [f.result() for f in futures]


def _check(
    results: list[tuple[list[int], inference_pb2.FinalInfo]],
    reference: Reference,
    victim_id: str,
) -> None:
    """Both requests ended on the live decode worker, on their first leg, with the
    reference's tokens (so the one placed on the stopped worker moved before its first
    token)."""
    for (tokens, final), name in zip(results, CASES, strict=True):
        assert final.migrations == 0, final
        assert final.decode_worker != victim_id, final
        reference.check({name: tokens}, [name])


def test_reserve_on_a_stopped_decode_worker_moves(
    cluster: E2ECluster, reference: Reference
) -> None:
    _router_uses_both_decoders(cluster)
    victim = _role(cluster, "decode")[0]
    victim_id = cluster.status(victim.address).worker_id
    os.kill(victim.process.pid, signal.SIGSTOP)
    try:
        results = _send_both(cluster)
    finally:
        os.kill(victim.process.pid, signal.SIGCONT)
    _check(results, reference, victim_id)
    cluster.wait_no_leaks(60.0)


def test_a_push_into_a_stopped_decode_worker_moves(
    cluster: E2ECluster, reference: Reference
) -> None:
    _router_uses_both_decoders(cluster)
    (prefill,) = _role(cluster, "prefill")
    decoders = _role(cluster, "decode")
    victim = decoders[0]
    victim_id = cluster.status(victim.address).worker_id
    os.kill(prefill.process.pid, signal.SIGSTOP)
    stopped = [prefill]
    try:
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(_send_both, cluster)
            wait_until(  # 1. both reserved, one on each decode worker; P holds the prefills
                lambda: all(cluster.status(w.address).num_receiving == 1 for w in decoders),
                DEADLINE_S,
                "a reservation on each decode worker",
            )
            os.kill(victim.process.pid, signal.SIGSTOP)  # 2. the push's target stops
            stopped.append(victim)
            os.kill(prefill.process.pid, signal.SIGCONT)  # 3. P prefills, pushes into it
            stopped.remove(prefill)
            results = sent.result()
    finally:
        for w in stopped:
            os.kill(w.process.pid, signal.SIGCONT)
    _check(results, reference, victim_id)
    cluster.wait_no_leaks(60.0)
