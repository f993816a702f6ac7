"""Prefill and decode worker processes driven by a direct gRPC client playing the router.

Real processes (`python -m worker_main`, started by fixtures, ready on their READY line,
stopped by PID) on the tiny model; KV moves over gloo. The client runs the router's hand-off:
Reserve on D -> Prefill on P with the ticket -> Decode stream on D. Oracle: the colocated
LLMEngine in this process, greedy, one prompt at a time. After every test both workers' free
KV blocks return to their totals (`GetStatus`), whatever was aborted, expired or killed.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from kvtransfer.wire import PEER_SLACK_S
from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.sampling_params import SamplingParams
from proto.pdserve.v1 import worker_pb2 as pb
from proto.pdserve.v1 import worker_pb2_grpc
from proto.pdserve.v1.trailers import failed_peer
from worker.process import WorkerProcess
from worker.step_gate import hold, release

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(block_size=8, num_kv_blocks=160, max_num_batched_tokens=64, max_num_seqs=8)
OPTS = [("grpc.enable_http_proxy", 0)]


def spawn(model: Path, role: str, worker_id: str) -> WorkerProcess:
    args = ["--model", str(model), "--role", role, "--worker-id", worker_id]
    args += ["--engine-json", ENGINE.model_dump_json(), "--torch-threads", "1"]
    return WorkerProcess.spawn(args)


@dataclass
class Worker:
    proc: WorkerProcess
    stub: worker_pb2_grpc.WorkerStub

    def status(self) -> pb.WorkerStatus:
        return self.stub.GetStatus(pb.GetStatusRequest(), timeout=5)

    def wait_all_free(self, timeout_s: float = 5.0) -> None:
        deadline = time.monotonic() + timeout_s
        while (s := self.status()).free_blocks != s.total_blocks:
            assert time.monotonic() < deadline, f"{s.worker_id}: {s.free_blocks}/{s.total_blocks}"
            time.sleep(0.02)


@pytest.fixture(scope="module")
def pd(tiny_model_dir: Path, hold_dir: Path) -> Iterator[tuple[Worker, Worker]]:
    procs = [spawn(tiny_model_dir, "prefill", "p0"), spawn(tiny_model_dir, "decode", "d0")]
    channels = [grpc.insecure_channel(p.address, OPTS) for p in procs]
    prefill, decode = (
        Worker(p, worker_pb2_grpc.WorkerStub(c)) for p, c in zip(procs, channels, strict=True)
    )
    yield prefill, decode
    for c in channels:
        c.close()
    assert [p.stop() for p in procs] == [0, 0]  # SIGTERM: clean exit


@pytest.fixture(autouse=True)
def no_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "pd" in request.fixturenames:
        for w in request.getfixturevalue("pd"):
            w.wait_all_free()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine.from_model_dir(tiny_model_dir, ENGINE)


def expected(oracle: LLMEngine, prompt: list[int], max_tokens: int) -> list[int]:
    return list(
        oracle.generate([prompt], SamplingParams(max_tokens=max_tokens))[0].output_token_ids
    )


def run(
    p: Worker,
    d: Worker,
    rid: str,
    prompt: list[int],
    max_tokens: int,
    timeout_s: float = 30.0,
    sampling: pb.WorkerSampling | None = None,
) -> tuple[list[int], pb.PrefillResponse, list[pb.TokenChunk]]:
    """The router's hand-off; returns (all tokens, the Prefill answer, the Decode chunks).
    `sampling` defaults to greedy with `max_tokens`."""
    sampling = sampling or pb.WorkerSampling(max_tokens=max_tokens)
    ticket = d.stub.Reserve(
        pb.ReserveRequest(
            request_id=rid,
            num_prompt_tokens=len(prompt),
            max_tokens=max_tokens,
            timeout_s=timeout_s,
        ),
        timeout=timeout_s,
    ).ticket
    pre = p.stub.Prefill(
        pb.PrefillRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=sampling,
            ticket=ticket,
            timeout_s=timeout_s,
        ),
        timeout=timeout_s,
    )
    if pre.finished:
        assert d.stub.Abort(pb.AbortRequest(request_id=rid), timeout=5).found
        return [pre.first_token], pre, []
    req = pb.DecodeRequest(
        request_id=rid,
        transfer_id=ticket.transfer_id,
        prompt_token_ids=prompt,
        first_token=pre.first_token,
        sampling=sampling,
        timeout_s=timeout_s,
    )
    chunks = list(d.stub.Decode(req, timeout=timeout_s))
    tokens = [pre.first_token] + [t for c in chunks for t in c.token_ids]
    return tokens, pre, chunks


def reserve(d: Worker, rid: str, n: int, max_tokens: int, timeout_s: float) -> pb.TransferTicket:
    req = pb.ReserveRequest(
        request_id=rid, num_prompt_tokens=n, max_tokens=max_tokens, timeout_s=timeout_s
    )
    return d.stub.Reserve(req, timeout=5).ticket


def rpc_error(fn: Callable[[], object]) -> grpc.Call:
    """The error `fn()` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert isinstance(info.value, grpc.Call), info.value
    return info.value


def code_of(fn: Callable[[], object]) -> grpc.StatusCode:
    return rpc_error(fn).code()


# ---------------------------------------------------------------------- fidelity


@pytest.mark.parametrize(
    "name,prompt",
    [
        ("one-token", [17]),
        ("one-block", list(range(100, 108))),
        ("many-blocks", [(i * 37) % 1000 + 3 for i in range(150)]),  # 3 prefill chunks
        ("partial", list(range(5, 40))),
    ],
)
def test_greedy_matches_colocated(
    pd: tuple[Worker, Worker], oracle: LLMEngine, name: str, prompt: list[int]
) -> None:
    p, d = pd
    tokens, pre, chunks = run(p, d, f"fid-{name}", prompt, 10)
    assert tokens == expected(oracle, prompt, 10)
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert pre.compute_ms > 0 and pre.transfer_ms > 0 and chunks[0].first_step_ms > 0
    print(
        f"\n{name}: prompt {len(prompt)}: queue {pre.queue_ms} ms, compute {pre.compute_ms} ms, "
        f"transfer {pre.transfer_ms} ms, decode admission {chunks[0].admission_ms} ms, "
        f"first step {chunks[0].first_step_ms} ms"
    )


def test_seeded_sampling_matches_colocated(pd: tuple[Worker, Worker], oracle: LLMEngine) -> None:
    """A seeded sampled request draws the same tokens split over P and D as in one engine: the
    decode side continues the seed's stream after the prefill side's draw."""
    p, d = pd
    prompt = [(i * 53) % 1000 + 4 for i in range(40)]
    temperature = 0.8999999761581421  # 0.9 as float32: what the wire carries
    sampling = pb.WorkerSampling(
        max_tokens=12, temperature=temperature, top_k=50, has_seed=True, seed=4321
    )
    tokens, _, _ = run(p, d, "seeded", prompt, 12, sampling=sampling)
    params = SamplingParams(max_tokens=12, temperature=temperature, top_k=50, seed=4321)
    assert tokens == list(oracle.generate([prompt], params)[0].output_token_ids)


def test_prefix_cache_hit_on_prefill(pd: tuple[Worker, Worker], oracle: LLMEngine) -> None:
    p, d = pd
    shared = [(i * 13) % 900 + 4 for i in range(32)]
    first, _, _ = run(p, d, "pfx-a", [*shared, 1, 2, 3, 4, 5, 6], 6)
    prompt = [*shared, 9, 8, 7, 6, 5, 4, 3, 2]
    tokens, pre, _ = run(p, d, "pfx-b", prompt, 6)
    assert pre.cached_tokens == 32  # the four shared full blocks
    assert tokens == expected(oracle, prompt, 6)
    assert first == expected(oracle, [*shared, 1, 2, 3, 4, 5, 6], 6)


def test_concurrent_requests(pd: tuple[Worker, Worker], oracle: LLMEngine) -> None:
    p, d = pd
    prompts = [[(i * 7 + j * 31) % 1000 + 3 for j in range(10 + 23 * i)] for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, p, d, f"conc-{i}", q, 16) for i, q in enumerate(prompts)]
        results = [f.result() for f in futures]
    for q, (tokens, _, _) in zip(prompts, results, strict=True):
        assert tokens == expected(oracle, q, 16)


def test_first_token_that_ends_the_request(pd: tuple[Worker, Worker], oracle: LLMEngine) -> None:
    p, d = pd
    tokens, pre, _ = run(p, d, "max1", [3, 1, 4, 1, 5], 1)  # the client aborts D's reservation
    assert pre.finished and pre.finish_reason == "length"
    assert tokens == expected(oracle, [3, 1, 4, 1, 5], 1)


# ---------------------------------------------------------------------- aborts and deadlines


def test_abort_mid_decode_frees_blocks(pd: tuple[Worker, Worker], hold_dir: Path) -> None:
    """The decode worker holds after its first steps: the request still runs when the Abort
    comes, on any machine."""
    p, d = pd
    prompt = list(range(50, 70))
    ticket = reserve(d, "ab", len(prompt), 64, 30)
    sampling = pb.WorkerSampling(max_tokens=64)
    pre = p.stub.Prefill(
        pb.PrefillRequest(
            request_id="ab", prompt_token_ids=prompt, sampling=sampling, ticket=ticket
        ),
        timeout=30,
    )
    hold(hold_dir, "d0", until_steps=d.status().engine_steps + 3)
    try:
        call = d.stub.Decode(
            pb.DecodeRequest(
                request_id="ab",
                transfer_id=ticket.transfer_id,
                prompt_token_ids=prompt,
                first_token=pre.first_token,
                sampling=sampling,
            ),
            timeout=30,
        )
        next(call), next(call)
        assert d.stub.Abort(pb.AbortRequest(request_id="ab"), timeout=5).found
    finally:
        release(hold_dir, "d0")
    assert code_of(lambda: list(call)) == grpc.StatusCode.ABORTED
    assert not d.stub.Abort(pb.AbortRequest(request_id="ab"), timeout=5).found
    assert not p.stub.Abort(pb.AbortRequest(request_id="ab"), timeout=5).found


def test_client_cancel_and_deadline_free_blocks(pd: tuple[Worker, Worker], hold_dir: Path) -> None:
    """The decode worker is held after its first steps (`worker.step_gate`), so the request is
    still running, whatever the machine's speed, when its client cancels or its deadline
    passes; either way its blocks come back."""
    p, d = pd
    for rid, cancel in (("cancel", True), ("deadline", False)):
        prompt = list(range(80, 100))
        ticket = reserve(d, rid, len(prompt), 64, 30)
        sampling = pb.WorkerSampling(max_tokens=64)
        pre = p.stub.Prefill(
            pb.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, ticket=ticket
            ),
            timeout=30,
        )
        req = pb.DecodeRequest(
            request_id=rid,
            transfer_id=ticket.transfer_id,
            prompt_token_ids=prompt,
            first_token=pre.first_token,
            sampling=sampling,
            timeout_s=30.0 if cancel else 0.3,
        )
        hold(hold_dir, "d0", until_steps=d.status().engine_steps + 2)  # 2 steps, then held
        try:
            call = d.stub.Decode(req, timeout=30)
            next(call)
            if cancel:
                call.cancel()
            else:
                assert code_of(lambda c=call: list(c)) == grpc.StatusCode.DEADLINE_EXCEEDED
            d.wait_all_free()
        finally:
            release(hold_dir, "d0")


def test_reservation_without_decode_expires(pd: tuple[Worker, Worker]) -> None:
    _, d = pd
    total = d.status().total_blocks
    ticket = reserve(d, "lonely", 40, 8, 0.5)
    assert len(ticket.block_ids) == 6  # ceil((40 + 8 - 1) / 8)
    assert d.status().free_blocks == total - 6
    d.wait_all_free(timeout_s=3.0)
    late = pb.DecodeRequest(request_id="lonely", transfer_id=ticket.transfer_id, first_token=1)
    assert (
        code_of(lambda: list(d.stub.Decode(late, timeout=5))) == grpc.StatusCode.DEADLINE_EXCEEDED
    )


def test_status_counts_a_reservation_receiving_kv_apart(pd: tuple[Worker, Worker]) -> None:
    """A reservation waits (`num_waiting`) and, until its KV is in, is `num_receiving` too:
    the prompt waits for the prefill worker, not for this decode worker."""
    p, d = pd

    def until(what: str, ok: Callable[[pb.WorkerStatus], bool]) -> None:
        deadline = time.monotonic() + 30.0
        while not ok(s := d.status()):
            assert time.monotonic() < deadline, f"{what}: {s}"
            time.sleep(0.02)

    prompt = list(range(30, 50))
    ticket = reserve(d, "recv", len(prompt), 4, 30)
    until("reserved", lambda s: (s.num_waiting, s.num_receiving) == (1, 1))
    sampling = pb.WorkerSampling(max_tokens=4)
    p.stub.Prefill(
        pb.PrefillRequest(
            request_id="recv", prompt_token_ids=prompt, sampling=sampling, ticket=ticket
        ),
        timeout=30,
    )
    until("KV in, no Decode yet", lambda s: (s.num_waiting, s.num_receiving) == (1, 0))
    assert d.stub.Abort(pb.AbortRequest(request_id="recv"), timeout=5).found
    d.wait_all_free()
    p.wait_all_free()


def test_same_request_id_again_right_after_abort(pd: tuple[Worker, Worker]) -> None:
    """A router retry reuses the request id while the aborted transfer is still winding down."""
    _, d = pd
    first = reserve(d, "again", 20, 4, 30)  # no prefill: its transfer stays in flight
    assert d.stub.Abort(pb.AbortRequest(request_id="again"), timeout=5).found
    second = reserve(d, "again", 20, 4, 30)
    assert second.transfer_id != first.transfer_id
    assert d.stub.Abort(pb.AbortRequest(request_id="again"), timeout=5).found


@pytest.mark.parametrize("delay_s", [0.0, 0.02, 0.08, 0.3])
def test_abort_in_any_state_releases_both_sides(pd: tuple[Worker, Worker], delay_s: float) -> None:
    """Abort P and D at a moment that lands in queued / prefilling / transferring / done."""
    p, d = pd
    rid = f"any-{delay_s}"
    prompt = [(i * 11) % 1000 + 3 for i in range(900)]
    ticket = reserve(d, rid, len(prompt), 4, 30)
    req = pb.PrefillRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=pb.WorkerSampling(max_tokens=4),
        ticket=ticket,
    )
    outcome: list[object] = []
    t = threading.Thread(
        target=lambda: outcome.append(_outcome(lambda: p.stub.Prefill(req, timeout=30)))
    )
    t.start()
    time.sleep(delay_s)
    p.stub.Abort(pb.AbortRequest(request_id=rid), timeout=5)
    d.stub.Abort(pb.AbortRequest(request_id=rid), timeout=5)  # found unless P's cancel got there
    t.join(30)
    assert outcome and outcome[0] in ("ok", grpc.StatusCode.ABORTED, grpc.StatusCode.UNAVAILABLE)


def _outcome(fn: Callable[[], object]) -> object:
    try:
        fn()
        return "ok"
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call), exc
        return exc.code()


# ---------------------------------------------------------------------- faults and misuse


def test_prefill_killed_mid_prefill_frees_decode_blocks(
    tiny_model_dir: Path, pd: tuple[Worker, Worker]
) -> None:
    _, d = pd
    victim = spawn(tiny_model_dir, "prefill", "victim")
    try:
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(victim.address, OPTS))
        prompt = [(i * 3) % 1000 + 3 for i in range(1000)]
        ticket = reserve(d, "killed", len(prompt), 8, 3.0)
        sampling = pb.WorkerSampling(max_tokens=8)
        req = pb.PrefillRequest(
            request_id="killed", prompt_token_ids=prompt, sampling=sampling, ticket=ticket
        )
        fut = stub.Prefill.future(req, timeout=30)
        time.sleep(0.05)
        victim.kill()
        assert fut.exception(10) is not None  # UNAVAILABLE: the connection dropped
        started = time.monotonic()
        decode = pb.DecodeRequest(
            request_id="killed",
            transfer_id=ticket.transfer_id,
            prompt_token_ids=prompt,
            first_token=5,
            sampling=sampling,
            timeout_s=20,
        )
        err = rpc_error(lambda: list(d.stub.Decode(decode, timeout=20)))
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        assert "KV transfer" in err.details() and "freed" in err.details(), err.details()
        assert time.monotonic() - started < 4.0  # the ticket's 3 s deadline, not the 20 s one
    finally:
        victim.kill()


def test_decode_killed_mid_prefill_blames_the_decode_worker(
    tiny_model_dir: Path, pd: tuple[Worker, Worker]
) -> None:
    """P's KV push to a SIGKILLed D fails: P answers UNAVAILABLE naming D, in words and in the
    `FAILED_PEER` trailer (the router then blames D, not P), and frees its blocks."""
    p, _ = pd
    victim = spawn(tiny_model_dir, "decode", "victim-d")
    try:
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(victim.address, OPTS))
        prompt = [(i * 7) % 1000 + 3 for i in range(1000)]
        req = pb.ReserveRequest(
            request_id="orphan", num_prompt_tokens=len(prompt), max_tokens=8, timeout_s=3.0
        )
        ticket = stub.Reserve(req, timeout=5).ticket
        prefill = pb.PrefillRequest(
            request_id="orphan",
            prompt_token_ids=prompt,
            sampling=pb.WorkerSampling(max_tokens=8),
            ticket=ticket,
        )
        fut = p.stub.Prefill.future(prefill, timeout=30)
        time.sleep(0.05)
        victim.kill()
        err = fut.exception(20)
        assert isinstance(err, grpc.Call), err
        assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
        assert "victim-d" in err.details(), err.details()
        assert failed_peer(err.trailing_metadata()) == "victim-d"
    finally:
        victim.kill()


@pytest.mark.parametrize("joined", [False, True], ids=["joining", "joined"])
def test_a_push_into_a_frozen_decode_worker_gives_up_and_blames_it(
    tiny_model_dir: Path, pd: tuple[Worker, Worker], joined: bool
) -> None:
    """D answered its Reserve, then froze (SIGSTOP) before P pushed a byte: P's push gives up
    by the transport's bound (the ticket's deadline + `PEER_SLACK_S`; a join, by the connect
    timeout), and P answers UNAVAILABLE naming D in the `FAILED_PEER` trailer, then frees its
    blocks. `joined`: P already streams to D on a pair (the exchange stalls, not the join)."""
    p, _ = pd
    victim = spawn(tiny_model_dir, "decode", "frozen-d")
    try:
        stub = worker_pb2_grpc.WorkerStub(grpc.insecure_channel(victim.address, OPTS))
        vd = Worker(victim, stub)
        prompt = [(i * 11) % 1000 + 3 for i in range(40)]
        sampling = pb.WorkerSampling(max_tokens=4)
        if joined:  # one whole hand-off first: the pair P -> D is up
            ticket = reserve(vd, "warm", len(prompt), 4, 10.0)
            req = pb.PrefillRequest(
                request_id="warm", prompt_token_ids=prompt, sampling=sampling, ticket=ticket
            )
            first = p.stub.Prefill(req, timeout=10).first_token
            dec = pb.DecodeRequest(
                request_id="warm",
                transfer_id=ticket.transfer_id,
                prompt_token_ids=prompt,
                first_token=first,
                sampling=sampling,
            )
            assert len([c for c in vd.stub.Decode(dec, timeout=10)]) >= 1
        ticket = reserve(vd, "stuck", len(prompt), 4, 3.0)  # the ticket's deadline: 3 s
        os.kill(victim.pid, signal.SIGSTOP)
        try:
            req = pb.PrefillRequest(
                request_id="stuck",
                prompt_token_ids=prompt,
                sampling=sampling,
                ticket=ticket,
                timeout_s=60.0,
            )
            started = time.monotonic()
            err = rpc_error(lambda: p.stub.Prefill(req, timeout=60))
            took = time.monotonic() - started
            assert err.code() == grpc.StatusCode.UNAVAILABLE, err.details()
            assert failed_peer(err.trailing_metadata()) == "frozen-d", err.details()
            assert took < 3.0 + PEER_SLACK_S + 10.0, took  # the ticket's bound, not the 60 s
            p.wait_all_free(timeout_s=3.0 + PEER_SLACK_S + 10.0)
        finally:
            os.kill(victim.pid, signal.SIGCONT)
    finally:
        victim.kill()


def test_wrong_role_and_bad_requests(pd: tuple[Worker, Worker]) -> None:
    p, d = pd
    gen = pb.WorkerGenerateRequest(request_id="g", prompt_token_ids=[1, 2])
    err = rpc_error(lambda: list(p.stub.Generate(gen, timeout=5)))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "role 'colocated'" in err.details() and "role 'prefill'" in err.details()
    fp, invalid = grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: reserve(p, "x", 4, 4, 5)) == fp
    no_ticket = pb.PrefillRequest(request_id="x", prompt_token_ids=[1])
    assert code_of(lambda: p.stub.Prefill(no_ticket, timeout=5)) == invalid
    assert code_of(lambda: d.stub.Prefill(no_ticket, timeout=5)) == fp
    assert code_of(lambda: reserve(d, "big", 1000, 100, 5)) == invalid  # beyond the context
    held = reserve(d, "hog", 900, 100, 30)  # 125 of 160 blocks
    assert code_of(lambda: reserve(d, "more", 900, 100, 5)) == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert code_of(lambda: reserve(d, "hog", 8, 8, 5)) == grpc.StatusCode.ALREADY_EXISTS
    # the prefill role's context check covers the whole request, not just its first token
    long = pb.PrefillRequest(
        request_id="hog",
        prompt_token_ids=[7] * 900,
        sampling=pb.WorkerSampling(max_tokens=200),
        ticket=held,
    )
    err = rpc_error(lambda: p.stub.Prefill(long, timeout=5))
    assert err.code() == invalid and "exceeds the model's context 1024" in err.details(), err
    wrong = pb.DecodeRequest(request_id="hog", transfer_id="nope", first_token=1)
    assert code_of(lambda: list(d.stub.Decode(wrong, timeout=5))) == fp
    assert held.block_ids and d.stub.Abort(pb.AbortRequest(request_id="hog"), timeout=5).found


def test_status_and_health(pd: tuple[Worker, Worker]) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    for w, role in zip(pd, ("prefill", "decode"), strict=True):
        s = w.status()
        assert (s.role, s.draining, s.block_size, s.total_blocks) == (role, False, 8, 160)
        assert s.kv_endpoint.startswith("127.0.0.1:") and s.epoch > 0
        with grpc.insecure_channel(w.proc.address, OPTS) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            for name in ("", "pdserve.v1.Worker"):
                resp = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING
