"""The decode role (`worker_main.ROLES["decode"]`, a `worker.composite` of
`RemoteDecodeRole` and `ColocatedRole`): remote and local prefill on one decode engine.

The test thread plays both engine threads, as in `test_role_interleavings`: a prefill role and
the decode role over loopback, each RPC entered through the role's `Rpc` table. One request
goes the disaggregated way (Reserve -> Prefill -> Decode), one is prefilled on the decode
worker itself (Generate), and both run in the same decode batches. Oracle: a colocated
`LLMEngine` on the same weights (greedy). Each script ends with every block free, neither role
holding anything and `check_integrity` passing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from decode_worker.decode import RemoteDecodeRole
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from prefill_worker.prefill import PrefillRole
from proto.pdserve.v1 import worker_pb2 as pb
from worker.composite import CompositeRole
from worker.kv_handoff import KVHandoff
from worker.roles import RoleContext, RoleHandler
from worker.sinks import Sink, StreamSink, UnarySink, WorkerError
from worker_main import ROLES

REMOTE_PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
LOCAL_PROMPT = [21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]
MAX_TOKENS = 6
CANCELLED = WorkerError(grpc.StatusCode.CANCELLED, "the test cancelled it")
# Budget 8 tokens a step: the 19-token local prompt takes three chunks, beside the decodes.
CFG = EngineConfig(block_size=4, num_kv_blocks=48, max_num_batched_tokens=8, max_num_seqs=4)


def rpc(role: RoleHandler, method: str, request: object, sink: Sink, timeout_s: float) -> None:
    """RPC `method` as the engine thread enters it: through the role's `Rpc` table."""
    role.dispatch(method, request, sink, timeout_s)


class Cluster:
    """A prefill role and a decode role, each on its own engine, over loopback."""

    def __init__(self, model_dir: Path) -> None:
        hub = LoopbackHub()
        self.p_engine = LLMEngine.from_model_dir(model_dir, CFG)
        self.d_engine = LLMEngine.from_model_dir(model_dir, CFG)
        self.p_tr = LoopbackTransport(hub, "p", self.p_engine.runner.kv_cache)
        self.d_tr = LoopbackTransport(hub, "d", self.d_engine.runner.kv_cache)
        self.p_handoff = KVHandoff(self.p_engine, self.p_tr, 1)
        self.d_handoff = KVHandoff(self.d_engine, self.d_tr, 1)
        self.p = PrefillRole(RoleContext(self.p_engine, self.p_handoff, "p", 30.0, 60.0))
        decode = ROLES["decode"]
        assert issubclass(decode, CompositeRole), decode
        self.d = decode(RoleContext(self.d_engine, self.d_handoff, "d", 30.0, 60.0))
        self.loop = asyncio.new_event_loop()
        self.totals = (self.p_engine.block_pool.num_free, self.d_engine.block_pool.num_free)
        self.mixed_steps = 0  # decode-engine steps that ran a local prefill chunk and a decode

    def sampling(self) -> pb.WorkerSampling:
        return pb.WorkerSampling(max_tokens=MAX_TOKENS, ignore_eos=True)

    def remote(self, rid: str) -> StreamSink:
        """Reserve on D, Prefill on P (one step, transfer delivered), then Decode on D."""
        reserve = UnarySink(self.loop)
        req = pb.ReserveRequest(
            request_id=rid, num_prompt_tokens=len(REMOTE_PROMPT), max_tokens=MAX_TOKENS
        )
        rpc(self.d, "Reserve", req, reserve, 30.0)
        ticket = self.loop.run_until_complete(reserve.wait()).ticket
        prefill = UnarySink(self.loop)
        self.p.prefill(pb.PrefillRequest(
                request_id=rid, prompt_token_ids=REMOTE_PROMPT, sampling=self.sampling(),
                ticket=ticket,
            ),
            prefill,
            30.0,
        )  # fmt: skip
        while not prefill.closed:
            self.p.on_outputs(self.p_engine.step(self.p.before_forward), 0.0, 0.0)
            self.d.on_handoff(self.d_handoff.poll()[0])
            self.p.on_handoff(self.p_handoff.poll()[0])
        answer: pb.PrefillResponse = self.loop.run_until_complete(prefill.wait())
        sink = StreamSink(self.loop)
        rpc(self.d, "Decode", pb.DecodeRequest(
                request_id=rid, transfer_id=ticket.transfer_id, first_token=answer.first_token,
                prompt_token_ids=REMOTE_PROMPT, sampling=self.sampling(),
            ),
            sink,
            30.0,
        )  # fmt: skip
        self.first_token = answer.first_token
        return sink

    def local(self, rid: str) -> StreamSink:
        sink = StreamSink(self.loop)
        req = pb.WorkerGenerateRequest(
            request_id=rid, prompt_token_ids=LOCAL_PROMPT, sampling=self.sampling()
        )
        rpc(self.d, "Generate", req, sink, 30.0)
        return sink

    def step(self) -> None:
        """One decode-engine step, as the engine thread runs it."""
        started = time.monotonic()
        kinds: set[bool] = set()

        def before(scheduled: object) -> object:
            for item in scheduled.items:  # type: ignore[attr-defined]
                kinds.add(len(item.token_ids) > 1)  # True: a prefill chunk; False: a decode
            return self.d.before_forward(scheduled)  # type: ignore[arg-type]

        outputs = self.d_engine.step(before)  # type: ignore[arg-type]
        self.mixed_steps += kinds == {True, False}
        self.d.on_outputs(outputs, started, time.monotonic())

    def run_to_end(self) -> None:
        for _ in range(200):
            if not self.d_engine.has_unfinished():
                return
            self.step()
        raise AssertionError("the decode engine never finished")

    def chunks(self, sink: StreamSink) -> tuple[list[pb.TokenChunk], WorkerError | None]:
        async def read() -> tuple[list[pb.TokenChunk], WorkerError | None]:
            out: list[pb.TokenChunk] = []
            try:
                async for chunk in sink:
                    out.append(chunk)
            except WorkerError as exc:
                return out, exc
            return out, None

        return self.loop.run_until_complete(read())

    def all_free(self) -> None:
        for role, engine, handoff, total in (
            (self.p, self.p_engine, self.p_handoff, self.totals[0]),
            (self.d, self.d_engine, self.d_handoff, self.totals[1]),
        ):
            assert role.num_active() == 0 and not handoff.in_flight(), role.name
            assert role.request_ids() == [], role.request_ids()
            engine.check_integrity()
            assert engine.block_pool.num_free == total, (role.name, engine.block_pool.num_free)


@pytest.fixture
def cluster(tiny_model_dir: Path) -> Iterator[Cluster]:
    c = Cluster(tiny_model_dir)
    yield c
    c.loop.close()


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path) -> dict[str, list[int]]:
    engine = LLMEngine.from_model_dir(tiny_model_dir, CFG)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return {
        name: list(engine.generate([prompt], params)[0].output_token_ids)
        for name, prompt in (("remote", REMOTE_PROMPT), ("local", LOCAL_PROMPT))
    }


def test_both_paths_share_the_decode_batches_with_oracle_tokens(
    cluster: Cluster, oracle: dict[str, list[int]]
) -> None:
    remote = cluster.remote("r")  # 1. admitted into D's batch: decoding
    local = cluster.local("l")  # 2. prefilled on D in chunks, beside r's decodes
    cluster.run_to_end()
    r_chunks, r_err = cluster.chunks(remote)
    l_chunks, l_err = cluster.chunks(local)
    assert r_err is None and l_err is None, (r_err, l_err)
    assert [cluster.first_token, *(t for c in r_chunks for t in c.token_ids)] == oracle["remote"]
    assert [t for c in l_chunks for t in c.token_ids] == oracle["local"]
    assert len(l_chunks[0].token_ids) == 1 and l_chunks[0].first_step_ms > 0  # Generate's head
    assert cluster.mixed_steps > 0  # 3. a local prefill chunk ran inside a decode batch
    cluster.all_free()


def test_an_id_live_on_one_path_is_refused_on_the_other(cluster: Cluster) -> None:
    cluster.local("x")
    with pytest.raises(WorkerError) as info:
        rpc(
            cluster.d,
            "Reserve",
            pb.ReserveRequest(request_id="x", num_prompt_tokens=4, max_tokens=2),
            UnarySink(cluster.loop),
            30.0,
        )
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    sink = cluster.remote("y")
    with pytest.raises(WorkerError) as info:
        rpc(
            cluster.d,
            "Generate",
            pb.WorkerGenerateRequest(request_id="y", prompt_token_ids=[1, 2, 3]),
            StreamSink(cluster.loop),
            30.0,
        )
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    cluster.d.abort_all(CANCELLED)
    assert cluster.chunks(sink)[1] is CANCELLED
    cluster.all_free()


@pytest.mark.parametrize("abort_with_rpc_sink", [False, True])
def test_abort_a_local_prefill_mid_chunk_frees_its_blocks(
    cluster: Cluster, abort_with_rpc_sink: bool
) -> None:
    remote = cluster.remote("r")
    local = cluster.local("l")
    cluster.step()  # 1. l's first chunk ran: part of its prompt is computed, blocks taken
    assert cluster.d_engine.block_pool.num_free < cluster.totals[1]
    assert not cluster.d.part(RemoteDecodeRole).abort(
        "l", None, CANCELLED
    )  # 2. not the remote part's
    assert cluster.d.abort("l", local if abort_with_rpc_sink else None, CANCELLED)
    assert cluster.chunks(local)[1] is CANCELLED
    assert cluster.d.request_ids() == ["r"]
    cluster.run_to_end()  # 3. r decodes on, unharmed
    assert cluster.chunks(remote)[1] is None
    cluster.all_free()


def test_a_local_request_expires_like_a_colocated_one(cluster: Cluster) -> None:
    sink = StreamSink(cluster.loop)
    req = pb.WorkerGenerateRequest(
        request_id="late", prompt_token_ids=LOCAL_PROMPT, sampling=cluster.sampling()
    )
    rpc(cluster.d, "Generate", req, sink, 0.01)
    deadline = time.monotonic() + 0.01
    while time.monotonic() <= deadline:  # the request's deadline passing is the state tested
        time.sleep(0.005)
    cluster.d.expire(time.monotonic())
    error = cluster.chunks(sink)[1]
    assert error is not None and error.code == grpc.StatusCode.DEADLINE_EXCEEDED
    cluster.all_free()
