"""The worker role contract, one test set run over every entry of `worker_main.ROLES`.

Each role runs in a real engine thread (`worker.engine_thread.EngineThread`) on the tiny model
over a loopback KV transport, with the peers a hand-off needs (a decode worker issues a
prefill role's tickets; a prefill worker pushes a decode role's KV). The test thread runs every
engine thread one loop iteration at a time (`_iterate`, with the loop's waits set to 0), so no
other thread runs and each state lasts as long as a script holds it. For every role:

1. every RPC of its table runs to its answer, with the colocated engine's greedy tokens (a
   script per RPC; an RPC no script covers fails here);
2. an RPC the worker does not serve is refused with a typed error — UNIMPLEMENTED for a method
   no role has, FAILED_PRECONDITION for another role's, INVALID_ARGUMENT for a request of the
   wrong type — never an assert;
3. a drain (SetRole to another role) refuses new work UNAVAILABLE, lets the work in flight
   finish with its tokens, then switches;
4. an Abort to every worker holding a request (what the router sends when a client cancels),
   at each state a script passes through, answers every open RPC of it;

and every test ends with every block of every worker free, no role or hand-off owner holding
anything and each engine's `check_integrity` passing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Generator, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from proto.pdserve.v1 import worker_pb2 as pb
from tests.fakes import sink_reader
from worker import engine_thread
from worker.engine_thread import EngineThread
from worker.kv_handoff import KVHandoff
from worker.roles import RoleContext
from worker.sinks import Sink, StreamSink, UnarySink, WorkerError
from worker_main import ROLES

# Budget 8 tokens a step: the 10-token prompt takes two chunks (a "prefilling" state).
CFG = EngineConfig(block_size=4, num_kv_blocks=32, max_num_batched_tokens=8, max_num_seqs=4)
PROMPT = list(range(5, 15))
MAX_TOKENS = 5
SAMPLING = pb.WorkerSampling(max_tokens=MAX_TOKENS, ignore_eos=True)
ROUNDS = 200  # engine-thread iterations a settle may take (each one moves something)
SWITCH_TO = {"prefill": "decode", "decode": "prefill", "colocated": "decode"}


class Node:
    """One worker: an engine thread (not started: the test runs its iterations) over a real
    engine, its hand-off owner and a loopback transport."""

    def __init__(self, hub: LoopbackHub, model_dir: Path, worker_id: str, role: str) -> None:
        self.engine = LLMEngine.from_model_dir(model_dir, CFG)
        transport = LoopbackTransport(hub, worker_id, self.engine.runner.kv_cache)
        self.handoff = KVHandoff(self.engine, transport, 1)
        ctx = RoleContext(self.engine, self.handoff, worker_id, 30.0, 60.0)
        self.thread = EngineThread(ctx, ROLES, role)
        self.total = self.engine.block_pool.num_free

    def turn(self) -> None:
        """One engine-thread iteration: commands, deadlines, a step, the hand-off's poll,
        drain progress."""
        self.thread._iterate()

    def idle(self) -> bool:
        role, thread = self.thread.role, self.thread
        return (
            thread._commands.empty()
            and thread._urgent.empty()
            and not self.engine.has_unfinished()
            and not self.handoff.in_flight()
            and role.num_active() == 0
            and self.handoff.num_abandoned() == 0
        )

    def check_all_free(self) -> None:
        assert self.idle(), (self.thread.role.name, self.thread.role.request_ids())
        self.engine.check_integrity()
        assert self.engine.block_pool.num_free == self.total, self.engine.block_pool.num_free


class Cluster:
    """The worker under test (`w`, in `role`) and the peer its hand-offs need."""

    def __init__(self, model_dir: Path, role: str) -> None:
        hub = LoopbackHub()
        self.loop = asyncio.new_event_loop()
        self.role = role
        self.w = Node(hub, model_dir, "w", role)
        self.p = Node(hub, model_dir, "p", "prefill") if role == "decode" else self.w
        self.d = Node(hub, model_dir, "d", "decode") if role == "prefill" else self.w
        self.nodes = list(dict.fromkeys([self.w, self.p, self.d]))
        self.sinks: list[Sink] = []  # every RPC a script opened

    def call(self, node: Node, method: str, request: object) -> Any:
        """Submit RPC `method` to `node`'s engine thread (it runs at the node's next turn)."""
        stream = method in ("Decode", "Generate")
        sink: Sink = StreamSink(self.loop) if stream else UnarySink(self.loop)
        self.sinks.append(sink)
        node.thread.submit(method, request, sink, 60.0)
        return sink

    def turns(self, *nodes: Node) -> None:
        for node in nodes or self.nodes:
            node.turn()

    def settle(self) -> None:
        for _ in range(ROUNDS):
            if all(node.idle() and node.thread._drain is None for node in self.nodes):
                return
            self.turns()
        raise AssertionError([n.thread.role.request_ids() for n in self.nodes])

    def answer(self, sink: UnarySink) -> Any:
        return sink_reader.answer(self.loop, sink)

    def stream(self, sink: StreamSink) -> tuple[list[int], WorkerError | None]:
        return sink_reader.tokens(self.loop, sink)

    def error(self, sink: Sink) -> WorkerError:
        """The error an RPC was refused with (it must have been)."""
        got = self.stream(sink)[1] if isinstance(sink, StreamSink) else self.answer(sink)
        assert isinstance(got, WorkerError), got
        return got

    def abort_everywhere(self, rid: str) -> None:
        """What the router does when a client cancels: Abort to every worker holding it."""
        for node in self.nodes:
            node.thread.abort(rid, UnarySink(self.loop))

    def check_all_free(self) -> None:
        for node in self.nodes:
            node.check_all_free()


# ---- one script per RPC of a role's table: they yield the states they pass through ----------

Script = Callable[[Cluster, str], Generator[str, None, list[int]]]


def generate(c: Cluster, rid: str) -> Generator[str, None, list[int]]:
    """`Generate` on the worker under test: queued, prefilling (one chunk), decoding."""
    req = pb.WorkerGenerateRequest(request_id=rid, prompt_token_ids=PROMPT, sampling=SAMPLING)
    sink = c.call(c.w, "Generate", req)
    yield "queued"
    c.turns(c.w)  # accepted; the prompt's first chunk runs
    yield "prefilling"
    c.turns(c.w)  # its last chunk: the first token
    yield "decoding"
    c.settle()
    tokens, error = c.stream(sink)
    assert error is None, error
    return tokens


def _reserve(c: Cluster, rid: str) -> pb.TransferTicket:
    sink = c.call(
        c.d,
        "Reserve",
        pb.ReserveRequest(request_id=rid, num_prompt_tokens=10, max_tokens=MAX_TOKENS),
    )
    c.turns(c.d)
    answer = c.answer(sink)
    assert isinstance(answer, pb.ReserveResponse), answer
    return answer.ticket


def _prefill_request(rid: str, ticket: pb.TransferTicket) -> pb.PrefillRequest:
    return pb.PrefillRequest(
        request_id=rid, prompt_token_ids=PROMPT, sampling=SAMPLING, ticket=ticket
    )


def _decode(c: Cluster, rid: str, ticket: pb.TransferTicket, first: int) -> StreamSink:
    req = pb.DecodeRequest(
        request_id=rid,
        transfer_id=ticket.transfer_id,
        first_token=first,
        prompt_token_ids=PROMPT,
        sampling=SAMPLING,
    )
    sink: StreamSink = c.call(c.d, "Decode", req)
    return sink


def prefill(c: Cluster, rid: str) -> Generator[str, None, list[int]]:
    """`Prefill` on the worker under test (its ticket from the decode peer): queued,
    prefilling, sending (the send open, its result not polled yet)."""
    ticket = _reserve(c, rid)
    sink = c.call(c.p, "Prefill", _prefill_request(rid, ticket))
    yield "queued"
    c.turns(c.p)
    yield "prefilling"
    c.turns(c.p)  # the last chunk: the send opens, the layers go, the first token
    yield "sending"
    c.turns(c.d, c.p)  # the decode side's result, then the sender's: answered
    answer = c.answer(sink)
    assert isinstance(answer, pb.PrefillResponse), answer
    stream = _decode(c, rid, ticket, answer.first_token)
    c.settle()
    tokens, error = c.stream(stream)
    assert error is None, error
    return [answer.first_token, *tokens]


def reserve_and_decode(c: Cluster, rid: str) -> Generator[str, None, list[int]]:
    """`Reserve` and `Decode` on the worker under test (the KV from the prefill peer):
    reserved, receiving (the layers landed, not polled), received (no Decode yet), decoding."""
    ticket = _reserve(c, rid)
    yield "reserved"
    answer_sink = c.call(c.p, "Prefill", _prefill_request(rid, ticket))
    c.turns(c.p)
    c.turns(c.p)  # the layers are in the decode side's inbox
    yield "receiving"
    c.turns(c.d, c.p)  # the decode side polls: RECEIVED; the sender's answer
    answer = c.answer(answer_sink)
    assert isinstance(answer, pb.PrefillResponse), answer
    yield "received"
    stream = _decode(c, rid, ticket, answer.first_token)
    c.turns(c.d)  # admitted; its first decode step
    yield "decoding"
    c.settle()
    tokens, error = c.stream(stream)
    assert error is None, error
    return [answer.first_token, *tokens]


SCRIPTS: dict[tuple[str, ...], tuple[Script, tuple[str, ...]]] = {
    ("Generate",): (generate, ("queued", "prefilling", "decoding")),
    ("Prefill",): (prefill, ("queued", "prefilling", "sending")),
    ("Decode", "Reserve"): (reserve_and_decode, ("reserved", "receiving", "received", "decoding")),
}


def scripts_of(role: str) -> list[tuple[Script, tuple[str, ...]]]:
    methods = ROLES[role].methods
    return [script for names, script in SCRIPTS.items() if set(names) <= methods]


def run(c: Cluster, script: Script, rid: str) -> list[int]:
    steps = script(c, rid)
    while True:
        try:
            next(steps)
        except StopIteration as done:
            tokens: list[int] = done.value
            return tokens


@pytest.fixture(scope="module")
def oracle(tiny_model_dir: Path) -> list[int]:
    engine = LLMEngine.from_model_dir(tiny_model_dir, CFG)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    return list(engine.generate([PROMPT], params)[0].output_token_ids)


@pytest.fixture(autouse=True)
def no_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """An iteration never waits for commands: the test decides what happens between them."""
    monkeypatch.setattr(engine_thread, "IDLE_WAIT_S", 0.0)
    monkeypatch.setattr(engine_thread, "TRANSFER_POLL_S", 0.0)


def cluster(tiny_model_dir: Path, role: str) -> Iterator[Cluster]:
    c = Cluster(tiny_model_dir, role)
    yield c
    c.loop.close()


@pytest.fixture(params=sorted(ROLES))
def role_cluster(tiny_model_dir: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    yield from cluster(tiny_model_dir, request.param)


# ---- 1. every RPC of the table ----------------------------------------------------------------


def test_every_rpc_of_the_table_answers(role_cluster: Cluster, oracle: list[int]) -> None:
    c = role_cluster
    covered = {m for names in SCRIPTS for m in names if set(names) <= ROLES[c.role].methods}
    assert covered == ROLES[c.role].methods, "an RPC of the table has no script here"
    for i, (script, _) in enumerate(scripts_of(c.role)):
        assert run(c, script, f"r{i}") == oracle, script.__name__
        c.check_all_free()


# ---- 2. what the worker does not serve ----------------------------------------------------------


def test_rpcs_the_role_does_not_serve_are_refused_typed(role_cluster: Cluster) -> None:
    c = role_cluster
    req = pb.WorkerGenerateRequest(request_id="x", prompt_token_ids=PROMPT, sampling=SAMPLING)
    unknown = c.call(c.w, "Bogus", req)  # 1. no role serves it
    other = next(
        m for r in ROLES.values() for m in sorted(r.methods) if m not in ROLES[c.role].methods
    )
    elsewhere = c.call(c.w, other, req)  # 2. another role's
    c.turns(c.w)
    assert [c.error(unknown).code, c.error(elsewhere).code] == [
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.FAILED_PRECONDITION,
    ]
    method = sorted(ROLES[c.role].methods)[0]  # 3. its own, with a request of another type
    with pytest.raises(WorkerError) as info:
        c.w.thread.role.dispatch(method, pb.AbortRequest(request_id="x"), UnarySink(c.loop), 1.0)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT, info.value
    with pytest.raises(WorkerError) as info:
        c.w.thread.role.dispatch("Bogus", req, UnarySink(c.loop), 1.0)
    assert info.value.code == grpc.StatusCode.UNIMPLEMENTED, info.value
    c.check_all_free()


# ---- 3. drain -----------------------------------------------------------------------------------


def test_a_drain_refuses_new_work_finishes_the_rest_then_switches(
    role_cluster: Cluster, oracle: list[int]
) -> None:
    c = role_cluster
    script, states = scripts_of(c.role)[0]
    steps = script(c, "a")
    for _ in states:  # 1. the request is in its last state before it finishes
        next(steps)
    target = SWITCH_TO[c.role]
    switched = UnarySink(c.loop)
    c.w.thread.set_role(target, 60.0, switched)
    c.turns(c.w)  # 2. draining: new work is refused
    assert c.w.thread.snapshot.draining
    new = sorted(ROLES[c.role].new_work)[0]
    req = {
        "Generate": pb.WorkerGenerateRequest(request_id="b", prompt_token_ids=PROMPT),
        "Prefill": pb.PrefillRequest(request_id="b", prompt_token_ids=PROMPT),
        "Reserve": pb.ReserveRequest(request_id="b", num_prompt_tokens=10, max_tokens=2),
    }[new]
    refused = c.call(c.w, new, req)
    c.turns(c.w)
    assert c.error(refused).code == grpc.StatusCode.UNAVAILABLE
    try:  # 3. the request in flight runs to its end
        while True:
            next(steps)
    except StopIteration as done:
        assert done.value == oracle
    c.settle()  # 4. nothing held: the role switched
    assert c.answer(switched) is None
    assert c.w.thread.role.name == target and not c.w.thread.snapshot.draining
    c.check_all_free()


# ---- 4. Abort at each state ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("role", "script", "state"),
    [
        (role, script.__name__, state)
        for role in sorted(ROLES)
        for script, states in scripts_of(role)
        for state in states
    ],
)
def test_abort_at_each_state_answers_and_frees_everything(
    tiny_model_dir: Path, role: str, script: str, state: str
) -> None:
    for c in cluster(tiny_model_dir, role):
        steps = {s.__name__: s for s, _ in scripts_of(role)}[script](c, "a")
        while next(steps) != state:
            pass
        c.abort_everywhere("a")  # the client cancelled: every worker holding it gets an Abort
        c.settle()
        for sink in c.sinks:  # every RPC the request opened has its answer
            assert sink.closed, (state, sink)
        c.check_all_free()
