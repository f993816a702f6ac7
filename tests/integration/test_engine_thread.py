"""The engine thread runs a role's `between_layers` RPCs in the middle of a long forward pass
(a decode worker's Reserve must not wait for a whole decode step), and everything else only
between steps."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from model_runtime.engine import EngineConfig, LLMEngine, RequestOutput
from model_runtime.sampling_params import SamplingParams
from worker.engine_thread import EngineThread
from worker.kv_handoff import KVHandoff
from worker.roles import RoleContext, RoleHandler, Rpc
from worker.sinks import Sink, UnarySink, WorkerError


class SlowStepRole(RoleHandler):
    """`Start` queues a long generation; `Ping` (between layers) and `Later` (between steps
    only) answer the time they ran."""

    name = "slow-step"

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.step_ends: list[float] = []

    def start(self, request: object, sink: UnarySink, timeout_s: float | None) -> None:
        params = SamplingParams(max_tokens=3, ignore_eos=True)
        self.engine.add_request("long", [4, 5, 6], params)
        sink.set(time.monotonic())

    def now(self, request: object, sink: UnarySink, timeout_s: float | None) -> None:
        sink.set(time.monotonic())

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        self.step_ends.append(ended)

    def expire(self, now: float) -> None:
        pass

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        return False

    def request_ids(self) -> list[str]:
        return list(self.engine.scheduler.requests)

    rpcs = (
        Rpc("Start", start, object, UnarySink),
        Rpc("Ping", now, object, UnarySink, new_work=False, between_layers=True),
        Rpc("Later", now, object, UnarySink, new_work=False),
    )


@pytest.fixture
def held_thread(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """An engine thread whose first step stops after its first layer until `release` is set
    (`in_step` says it got there): RPCs sent meanwhile arrive inside a step by construction."""
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    execute = engine.runner.execute
    in_step, release = threading.Event(), threading.Event()

    def held_execute(items: Any, on_layer_done: Any = None) -> Any:
        def each_layer(layer: int) -> None:
            in_step.set()
            assert release.wait(30.0), "the test never released the step"
            if on_layer_done is not None:
                on_layer_done(layer)

        return execute(items, each_layer)

    monkeypatch.setattr(engine.runner, "execute", held_execute)
    transport = LoopbackTransport(LoopbackHub(), "w", engine.runner.kv_cache)
    ctx = RoleContext(engine, KVHandoff(engine, transport, 1), "w", 30.0, 60.0)
    thread = EngineThread(ctx, {SlowStepRole.name: SlowStepRole}, SlowStepRole.name)
    thread.start()
    yield thread, in_step, release
    release.set()
    thread.stop(0.0)


def test_between_layers_rpcs_do_not_wait_for_the_step(held_thread: Any) -> None:
    thread, in_step, release = held_thread

    def send(method: str) -> UnarySink:
        sink = UnarySink(asyncio.get_running_loop())
        thread.submit(method, None, sink, 5.0)
        return sink

    async def scenario() -> None:
        await send("Start").wait()
        assert await asyncio.to_thread(in_step.wait, 30.0), "the first step never started"
        ping, later = send("Ping"), send("Later")  # both queued while the step is held
        release.set()
        ping_ran, later_ran = await ping.wait(), await later.wait()
        first_step_end = thread.role.step_ends[0]
        # `Ping` ran between two layers of the step in progress; `Later` waited for it to end.
        assert ping_ran < first_step_end <= later_ran, (ping_ran, first_step_end, later_ran)

    asyncio.run(scenario())
