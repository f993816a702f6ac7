"""The engine thread runs a role's `between_layers` RPCs in the middle of a long forward pass
(a decode worker's Reserve must not wait for a whole decode step), and everything else only
between steps."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from model_runtime.engine import EngineConfig, LLMEngine, RequestOutput
from model_runtime.sampling_params import SamplingParams
from worker.engine_thread import EngineThread
from worker.roles import Role, RoleContext
from worker.sinks import Sink, UnarySink, WorkerError

LAYER_S = 0.1  # each layer of the slowed-down model


class SlowStepRole(Role):
    """`Start` queues a long generation; `Ping` (between layers) and `Later` (between steps
    only) answer the time they ran."""

    name = "slow-step"
    methods = frozenset({"Start", "Ping", "Later"})
    new_work = frozenset({"Start"})
    between_layers = frozenset({"Ping"})

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.step_ends: list[float] = []

    def handle(self, method: str, request: Any, sink: Sink, timeout_s: float | None) -> None:
        assert isinstance(sink, UnarySink)
        if method == "Start":
            params = SamplingParams(max_tokens=3, ignore_eos=True)
            self.engine.add_request("long", [4, 5, 6], params)
        sink.set(time.monotonic())

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        self.step_ends.append(ended)

    def expire(self, now: float) -> None:
        pass

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        return False

    def request_ids(self) -> list[str]:
        return list(self.engine.scheduler.requests)


@pytest.fixture
def slow_thread(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(block_size=8, num_kv_blocks=64))
    execute = engine.runner.execute

    def slow_execute(items: Any, on_layer_done: Any = None) -> Any:
        def each_layer(layer: int) -> None:
            time.sleep(LAYER_S)
            if on_layer_done is not None:
                on_layer_done(layer)

        return execute(items, each_layer)

    monkeypatch.setattr(engine.runner, "execute", slow_execute)
    transport = LoopbackTransport(LoopbackHub(), "w", engine.runner.kv_cache)
    ctx = RoleContext(engine, transport, "w", 1, 30.0, 60.0)
    thread = EngineThread(ctx, {SlowStepRole.name: SlowStepRole}, SlowStepRole.name)
    thread.start()
    yield thread, engine.model_config.num_hidden_layers * LAYER_S
    thread.stop(0.0)


def test_between_layers_rpcs_do_not_wait_for_the_step(slow_thread: Any) -> None:
    thread, step_s = slow_thread

    async def call(method: str) -> tuple[float, float]:
        sink = UnarySink(asyncio.get_running_loop())
        sent = time.monotonic()
        thread.submit(method, None, sink, 5.0)
        return sent, await sink.wait()

    async def scenario() -> None:
        await call("Start")
        await asyncio.sleep(LAYER_S * 1.5)  # inside the first step now
        ping_sent, ping_ran = await call("Ping")
        later_sent, later_ran = await call("Later")
        role = thread.role
        assert ping_ran - ping_sent < 2.5 * LAYER_S < step_s, (ping_ran - ping_sent, step_s)
        # `Later` waited for the step in progress: it ran after that step ended.
        assert any(later_sent < end <= later_ran for end in role.step_ends), (
            later_sent,
            later_ran,
            role.step_ends,
        )

    asyncio.run(scenario())
