"""Fidelity and concurrency through real processes: colocated, 1P+1D, 2P+2D and hybrid 1P+1D
clusters give the in-process colocated engine's greedy tokens, one request at a time and 40 at
once, and a prefill worker switching role under traffic drops nothing. Every topology but one
speculates (`[engine.speculative]`, `SPECULATION`) while the reference does not: colocated with
the n-gram proposer, 1P1D and hybrid with a draft model that agrees with the target (the target
itself: every guess accepted, several tokens per step through the hand-off and the stream),
2P2D with an unrelated random draft (every guess rejected, k backing off; its role switch
carries the draft to the new role). The hybrid cluster
(`[router.hybrid]` local_prefill_max_tokens = `HYBRID_LOCAL`) prefills short prompts on its
decode worker and long ones on its prefill worker: both paths are taken, and each response says
which (`FinalInfo.prefill_path`).

Runs in the pytest process; one cluster per topology (module-scoped, parametrized), so pytest
runs every test of a topology before starting the next one.
"""

from __future__ import annotations

import threading
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.pdserve.v1 import inference_pb2, worker_pb2
from tests.e2e.helpers import ENGINE, PROMPTS, E2ECluster, Reference, wait_until

pytestmark = pytest.mark.slow

HYBRID_LOCAL = 64  # prompts of at most this many uncached tokens are prefilled on D
TOPOLOGIES: dict[str, tuple[str, dict[str, int], dict[str, object]]] = {
    "colocated": ("colocated", {"colocated": 1}, {}),
    "1p1d": ("disagg", {"prefill": 1, "decode": 1}, {}),
    "2p2d": ("disagg", {"prefill": 2, "decode": 2}, {}),
    "hybrid-1p1d": (
        "disagg",
        {"prefill": 1, "decode": 1},
        # the path by the threshold alone (no spill to an idler prefill worker), so which
        # path a prompt takes does not depend on what the router last polled
        {
            "router.hybrid.local_prefill_max_tokens": HYBRID_LOCAL,
            "router.hybrid.spill_to_prefill": False,
        },
    ),
}


# the proposer per topology: "ngram", "self" (the target as its own draft), "draft" (the tiny
# random draft)
SPECULATION = {"colocated": "ngram", "1p1d": "self", "2p2d": "draft", "hybrid-1p1d": "self"}


@pytest.fixture(scope="module", params=list(TOPOLOGIES))
def cluster(
    request: pytest.FixtureRequest,
    start_cluster: Callable[..., Iterator[E2ECluster]],
    tiny_model_dir: Path,
    tiny_draft_dir: Path,
) -> Iterator[E2ECluster]:
    mode, counts, overrides = TOPOLOGIES[request.param]
    method = SPECULATION[request.param]
    # max_step_rows: every request of the concurrent test may speculate too
    spec: dict[str, object] = {"method": "ngram", "num_speculative_tokens": 4, "max_step_rows": 256}
    if method != "ngram":
        model = tiny_model_dir if method == "self" else tiny_draft_dir
        spec = {**spec, "method": "draft", "model": str(model)}
    overrides = {**overrides, "engine": {**ENGINE, "speculative": spec}}  # ENGINE unchanged
    yield from start_cluster(request.param, mode, overrides, **counts)


def _expected_path(cluster: E2ECluster, prompt_tokens: int) -> set[str]:
    """The prefill paths a prompt of `prompt_tokens` may take on `cluster` (a prompt longer
    than the threshold may still go local when its prefix is cached on the decode worker)."""
    if cluster.name == "colocated":
        return {""}
    if not cluster.name.startswith("hybrid"):
        return {"remote"}
    return {"local"} if prompt_tokens <= HYBRID_LOCAL else {"local", "remote"}


def test_greedy_tokens_match_colocated_engine(cluster: E2ECluster, reference: Reference) -> None:
    got: dict[str, list[int]] = {}
    paths: dict[str, str] = {}
    for p in PROMPTS:  # one at a time, in order: the shared-prefix prompts hit the cache
        tokens, final = cluster.generate(p.request())
        got[p.name] = tokens
        n = len(reference.prompt_ids[p.name])
        assert final.usage.completion_tokens == len(tokens)
        assert final.usage.prompt_tokens == n
        assert final.finish_reason == ("length" if len(tokens) == p.max_tokens else "stop")
        assert final.prefill_path in _expected_path(cluster, n), (p.name, n, final)
        paths[p.name] = final.prefill_path
        if final.prefill_path == "local":  # prefilled and decoded on the decode worker
            assert final.prefill_worker == final.decode_worker
            assert final.prefill_path_reason == "short_prompt"
    reference.check(got)
    if cluster.name.startswith("hybrid"):  # both paths taken, the long prompts through P
        assert paths["len1"] == "local" and paths["len700"] == "remote", paths
    cluster.wait_no_leaks()


CONSTRAINED = {
    "json": inference_pb2.StructuredOutputs(
        json='{"type": "object", "properties": {"n": {"type": "integer"}, "tags": {"type": '
        '"array", "items": {"enum": ["a", "b"]}, "maxItems": 3}}, "required": ["n", "tags"], '
        '"additionalProperties": false}'
    ),
    "regex": inference_pb2.StructuredOutputs(regex="[a-z]{3,12}( [a-z]{2,9}){2,5}"),
    "choice": inference_pb2.StructuredOutputs(
        choice=inference_pb2.ChoiceList(choices=["up", "down"])
    ),
}


def test_constrained_tokens_match_colocated_engine(
    cluster: E2ECluster, reference: Reference
) -> None:
    """A grammar-constrained request gives the same tokens on every topology as the
    in-process engine (float32 greedy): the prefill worker samples its first token under the
    mask, the decode worker (or the hybrid local path) rebuilds the matcher and continues."""
    from model_runtime.sampling_params import SamplingParams
    from worker.convert import structured_from_proto

    prompt = list(reference.prompt_ids[PROMPTS[0].name])
    for name, so in CONSTRAINED.items():
        req = inference_pb2.GenerateRequest(
            request_id=f"constrained-{name}",
            token_ids=inference_pb2.TokenIds(ids=prompt),
            sampling=inference_pb2.SamplingParams(max_tokens=48, structured_outputs=so),
        )
        tokens, final = cluster.generate(req)
        params = SamplingParams(max_tokens=48, structured=structured_from_proto(so))
        (want,) = reference.engine.generate([prompt], params)
        assert tokens == list(want.output_token_ids), (name, final)
        assert final.finish_reason == want.finish_reason
    cluster.wait_no_leaks()


def test_concurrent_requests_all_complete(cluster: E2ECluster, reference: Reference) -> None:
    cases = [p for p in PROMPTS if len(reference.prompt_ids[p.name]) <= 300] * 2
    assert len(cases) >= 32

    def run(i: int) -> tuple[str, list[int]]:
        p = cases[i]
        return p.name, cluster.generate(p.request(request_id=f"conc-{i}"), timeout=60.0)[0]

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = list(pool.map(run, range(len(cases))))
    for name, tokens in results:
        reference.check({name: tokens})
    cluster.wait_no_leaks()


def test_role_switch_under_traffic_drops_nothing(cluster: E2ECluster, reference: Reference) -> None:
    prefill = [w for w in cluster.local.workers.workers if w.role == "prefill"]
    if len(prefill) < 2:
        pytest.skip("a role switch under traffic needs two prefill workers (2p2d only)")
    mover, mover_id = prefill[-1].address, prefill[-1].worker_id
    stop = threading.Event()
    done: list[tuple[str, list[int], str, str]] = []  # name, tokens, prefill id, decode id
    errors: list[str] = []
    cases = [p for p in PROMPTS if len(reference.prompt_ids[p.name]) <= 100]

    def traffic(k: int) -> None:
        i = k
        while not stop.is_set():
            p = cases[i % len(cases)]
            i += 4
            try:
                tokens, final = cluster.generate(p.request(), timeout=60.0)
                done.append((p.name, tokens, final.prefill_worker, final.decode_worker))
            except grpc.RpcError as exc:
                errors.append(f"{p.name}: {exc.code().name}: {exc.details()}")  # type: ignore[attr-defined]

    def served_by_mover(role: str, after: int) -> bool:
        column = 2 if role == "prefill" else 3
        return any(d[column] == mover_id for d in done[after:])

    threads = [threading.Thread(target=traffic, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(done) >= 4, 30.0, "traffic before the switch")
        stub = cluster.worker_stub(mover)
        for role in ("decode", "prefill"):
            before = len(done)
            st = stub.SetRole(
                worker_pb2.SetRoleRequest(role=role, drain_timeout_s=20.0), timeout=30
            )
            assert st.role == role
            wait_until(
                lambda r=role, b=before: served_by_mover(r, b),
                30.0,
                f"a request served by {mover_id} as {role}",
            )
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not errors, f"requests failed during the role switches: {errors}"
    for name, tokens, _, _ in done:
        reference.check({name: tokens})
    assert cluster.status(mover).role == "prefill"
    cluster.wait_no_leaks()


def _spec_counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("pdserve:spec_decode_") and "position" not in s.labels
    }


def test_decoding_workers_speculated(cluster: E2ECluster) -> None:
    """The workers that decode (decode and colocated roles) speculated, under vLLM's metric
    names: a draft that is the target had its guesses accepted, an unrelated one not; the
    tokens above are the reference's all the same."""
    method = SPECULATION[cluster.name]
    got: dict[str, float] = {}
    for w in cluster.local.workers.workers:
        if w.role == "prefill":
            continue
        port = cluster.status(w.address).metrics_port
        for name, value in _spec_counters(f"http://127.0.0.1:{port}/metrics").items():
            got[name] = got.get(name, 0.0) + value
    assert "pdserve:spec_decode_num_draft_tokens_total" in got, got
    if method == "ngram":
        return  # random prompts: whether the n-gram proposer ever matches is up to them
    proposed = got["pdserve:spec_decode_num_draft_tokens_total"]
    accepted = got["pdserve:spec_decode_num_accepted_tokens_total"]
    assert proposed > 0, got
    if method == "self":
        assert accepted / proposed > 0.9, got
    else:
        assert accepted / proposed < 0.2, got
