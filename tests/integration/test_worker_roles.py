"""Worker roles on real processes: colocated Generate, SetRole draining and switching.

Two `python -m worker_main` processes on the tiny model: W1 starts as prefill, W2 as
colocated. Oracle: the colocated LLMEngine in this process (greedy). Checked: Generate streams
the oracle's tokens (first chunk = first token, with timings); a role switch under load lets
every accepted request finish with the oracle's tokens (new work during the drain is refused
with UNAVAILABLE, which a router retries elsewhere) and keeps the weights (no reload: the
switched workers serve the reversed hand-off at once); a drain timeout aborts what is left
with UNAVAILABLE. Free KV blocks return to their totals after every test.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.sampling_params import SamplingParams
from proto.pdserve.v1 import worker_pb2 as pb
from proto.pdserve.v1 import worker_pb2_grpc
from worker.process import WorkerProcess
from worker.step_gate import hold, release

pytestmark = pytest.mark.slow

ENGINE = EngineConfig(block_size=8, num_kv_blocks=256, max_num_batched_tokens=64, max_num_seqs=8)
OPTS = [("grpc.enable_http_proxy", 0)]
Stub = worker_pb2_grpc.WorkerStub
Oracle = Callable[[list[int], int], list[int]]
REFUSED = [(grpc.StatusCode.UNAVAILABLE, "draining"), (grpc.StatusCode.FAILED_PRECONDITION, "role")]
ADDRESSES: dict[int, str] = {}  # id(stub) -> address, for health checks


@pytest.fixture(scope="module")
def workers(tiny_model_dir: Path, hold_dir: Path) -> Iterator[tuple[Stub, Stub]]:
    procs, channels, stubs = [], [], []
    for role, wid in (("prefill", "w1"), ("colocated", "w2")):
        args = ["--model", str(tiny_model_dir), "--role", role, "--worker-id", wid]
        args += ["--engine-json", ENGINE.model_dump_json(), "--torch-threads", "1"]
        procs.append(WorkerProcess.spawn(args))
        channels.append(grpc.insecure_channel(procs[-1].address, OPTS))
        stubs.append(Stub(channels[-1]))
        ADDRESSES[id(stubs[-1])] = procs[-1].address
    yield stubs[0], stubs[1]
    for c in channels:
        c.close()
    assert [p.stop() for p in procs] == [0, 0]


def rpc_error(fn: Callable[[], object]) -> grpc.Call:
    """The error `fn()` fails with (it must fail)."""
    with pytest.raises(grpc.RpcError) as info:
        fn()
    assert isinstance(info.value, grpc.Call), info.value
    return info.value


@pytest.fixture(autouse=True)
def no_leaks(workers: tuple[Stub, Stub]) -> Iterator[None]:
    yield
    for stub in workers:
        deadline = time.monotonic() + 5
        while (s := stub.GetStatus(pb.GetStatusRequest(), timeout=5)).free_blocks != 256:
            assert time.monotonic() < deadline, (s.worker_id, s.free_blocks)
            time.sleep(0.02)


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path) -> Oracle:
    engine = LLMEngine.from_model_dir(tiny_model_dir, ENGINE)

    def run(prompt: list[int], max_tokens: int) -> list[int]:
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens))
        return list(out.output_token_ids)

    return run


def generate(stub: Stub, rid: str, prompt: list[int], max_tokens: int) -> list[pb.TokenChunk]:
    req = pb.WorkerGenerateRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling=pb.WorkerSampling(max_tokens=max_tokens),
        timeout_s=30,
    )
    return list(stub.Generate(req, timeout=30))


def disagg(p: Stub, d: Stub, rid: str, prompt: list[int], max_tokens: int) -> list[int] | str:
    """Reserve -> Prefill -> Decode; 'refused' if a worker answered UNAVAILABLE (draining)."""
    sampling = pb.WorkerSampling(max_tokens=max_tokens)
    try:
        ticket = d.Reserve(
            pb.ReserveRequest(
                request_id=rid, num_prompt_tokens=len(prompt), max_tokens=max_tokens, timeout_s=30
            ),
            timeout=30,
        ).ticket
    except grpc.RpcError as exc:
        assert isinstance(exc, grpc.Call) and exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return "refused"
    try:
        pre = p.Prefill(
            pb.PrefillRequest(
                request_id=rid, prompt_token_ids=prompt, sampling=sampling, ticket=ticket
            ),
            timeout=30,
        )
    except grpc.RpcError as exc:  # draining, or already switched: a router retries elsewhere
        assert isinstance(exc, grpc.Call), exc
        assert any(exc.code() == c and w in exc.details() for c, w in REFUSED), exc
        assert d.Abort(pb.AbortRequest(request_id=rid), timeout=5).found
        return "refused"
    decode = pb.DecodeRequest(
        request_id=rid,
        transfer_id=ticket.transfer_id,
        prompt_token_ids=prompt,
        first_token=pre.first_token,
        sampling=sampling,
    )
    chunks = list(d.Decode(decode, timeout=30))
    return [pre.first_token] + [t for c in chunks for t in c.token_ids]


def status(stub: Stub) -> pb.WorkerStatus:
    return stub.GetStatus(pb.GetStatusRequest(), timeout=5)


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def set_role(stub: Stub, role: str, drain_timeout_s: float = 30.0) -> pb.WorkerStatus:
    return stub.SetRole(pb.SetRoleRequest(role=role, drain_timeout_s=drain_timeout_s), timeout=60)


def test_colocated_generate_matches_oracle(workers: tuple[Stub, Stub], oracle: Oracle) -> None:
    _, w2 = workers
    prompts = [[9], list(range(200, 216)), [(i * 29) % 1000 + 3 for i in range(130)]]
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda i: generate(w2, f"gen-{i}", prompts[i], 12), range(3)))
    for prompt, chunks in zip(prompts, runs, strict=True):
        assert [t for c in chunks for t in c.token_ids] == oracle(prompt, 12)
        assert len(chunks[0].token_ids) == 1 and chunks[0].first_step_ms > 0
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    again = generate(w2, "gen-again", prompts[2], 2)  # the prompt's full blocks are cached now
    assert again[0].cached_tokens == 128


def test_wrong_role_and_bad_role(workers: tuple[Stub, Stub]) -> None:
    w1, w2 = workers
    for call in (
        lambda: w2.Prefill(pb.PrefillRequest(request_id="x"), timeout=5),
        lambda: w2.Reserve(pb.ReserveRequest(request_id="x"), timeout=5),
        lambda: list(w1.Generate(pb.WorkerGenerateRequest(request_id="x"), timeout=5)),
    ):
        assert rpc_error(call).code() == grpc.StatusCode.FAILED_PRECONDITION
    assert rpc_error(lambda: set_role(w1, "router")).code() == grpc.StatusCode.INVALID_ARGUMENT
    assert set_role(w1, "prefill").role == "prefill"  # same role: nothing to drain


def test_drain_timeout_aborts_what_is_left(workers: tuple[Stub, Stub], hold_dir: Path) -> None:
    """w2 is held after the request's first steps (`worker.step_gate`): whatever the machine's
    speed, the request is still there when the drain times out, and is ended UNAVAILABLE."""
    _, w2 = workers
    req = pb.WorkerGenerateRequest(
        request_id="long", prompt_token_ids=[5, 6, 7], sampling=pb.WorkerSampling(max_tokens=64)
    )
    hold(hold_dir, "w2", until_steps=status(w2).engine_steps + 2)
    try:
        call = w2.Generate(req, timeout=30)
        next(call)
        switched = set_role(w2, "decode", drain_timeout_s=0.2)
    finally:
        release(hold_dir, "w2")
    assert (switched.role, switched.draining) == ("decode", False)
    err = rpc_error(lambda: list(call))
    assert err.code() == grpc.StatusCode.UNAVAILABLE and "drain timeout" in err.details()


def test_role_switch_under_load_drops_nothing(workers: tuple[Stub, Stub], oracle: Oracle) -> None:
    w1, w2 = workers
    if status(w2).role != "decode":
        set_role(w2, "decode")
    prompts = [[(i * 17 + j * 5) % 1000 + 3 for j in range(120 + 30 * i)] for i in range(6)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(disagg, w1, w2, f"load-{i}", q, 20) for i, q in enumerate(prompts)]
        wait_for(lambda: (s := status(w1)).num_waiting + s.num_running > 0)  # w1 is busy
        request = pb.SetRoleRequest(role="decode", drain_timeout_s=30)
        switch = w1.SetRole.future(request, timeout=60)
        wait_for(lambda: status(w1).draining or switch.done())
        late = disagg(w1, w2, "late", prompts[0], 20)  # new work while draining: refused
        switched = switch.result()
        results = [f.result() for f in futures]
    assert late == "refused"
    assert (switched.role, switched.draining) == ("decode", False)
    done = [i for i, r in enumerate(results) if r != "refused"]
    assert done, "the switch started before any request was accepted"
    for i in done:
        assert results[i] == oracle(prompts[i], 20), i
    print(f"\nswitch under load: {len(done)} finished, {len(results) - len(done)} refused")
    # Same weights, same KV cache, roles reversed: w2 prefills into w1 now.
    assert set_role(w2, "prefill").role == "prefill"
    for i in (0, 5):
        assert disagg(w2, w1, f"rev-{i}", prompts[i], 20) == oracle(prompts[i], 20)
    for stub in workers:
        with grpc.insecure_channel(ADDRESSES[id(stub)], OPTS) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            resp = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
            assert resp.status == health_pb2.HealthCheckResponse.SERVING
