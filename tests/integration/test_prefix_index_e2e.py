"""End to end with real worker processes (2 prefill + 1 decode, tiny model), the router in
this process and a real redis-server: shared prefixes hit the prefill worker that holds them,
greedy outputs equal the colocated engine's without prefix reuse, and Redis killed mid-run
fails no request and heals when it comes back.

Workers are `python -m worker_main` processes started by `deploy.launcher.launch_workers`
(ready = READY line + health SERVING) and stopped by PID; Redis is started on a free port and
stopped by PID.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import grpc
import pytest

from deploy.config import load_cluster_config
from deploy.launcher import ProcessWorkers, launch_workers
from proto.pdserve.v1 import inference_pb2 as ipb
from proto.pdserve.v1 import inference_pb2_grpc
from router.app import RouterHandle, start_router
from router.prefix_index.config import RedisIndexConfig
from router.prefix_index.guard import reusable_chain
from tests.fakes.cluster import wait_until
from tooling.redis_server import SKIP_REASON, RedisServer, redis_server_path

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(redis_server_path() is None, reason=SKIP_REASON),
]

BLOCK = 16
ENGINE = {"block_size": BLOCK, "num_kv_blocks": 256, "max_num_batched_tokens": 512}
PREFIX = 4 * BLOCK
MAX_TOKENS = 6
TIE_TOL = 1e-3


def prompt(group: int, i: int) -> list[int]:
    shared = random.Random(group).choices(range(4, 1024), k=PREFIX)  # 0..3: special tokens
    return shared + random.Random(1000 * group + i).choices(range(4, 1024), k=5 + 3 * i)


@pytest.fixture(scope="module")
def workers(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ProcessWorkers]:
    config = load_cluster_config(
        None,
        {
            "model": str(tiny_model_dir),
            "mode": "disagg",
            "launcher": "process",
            "engine": ENGINE,
            "workers.prefill": 2,
            "workers.decode": 1,
        },
    )
    procs = launch_workers(config, tmp_path_factory.mktemp("prefix-e2e-logs"))
    try:
        yield procs
    finally:
        procs.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> dict[tuple[int, int], list[int]]:
    """Greedy tokens of the in-process colocated engine, prefix caching OFF."""
    from model_runtime.engine import EngineConfig, LLMEngine
    from model_runtime.sampling_params import SamplingParams

    engine = LLMEngine.from_model_dir(
        tiny_model_dir, EngineConfig(**{**ENGINE, "enable_prefix_caching": False})
    )
    out = {}
    for key in [(g, i) for g in range(6) for i in range(12)]:
        (res,) = engine.generate([prompt(*key)], SamplingParams(max_tokens=MAX_TOKENS))
        out[key] = list(res.output_token_ids)
    return out


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def router_over(workers: ProcessWorkers, model: Path, redis_url: str) -> RouterHandle:
    config = load_cluster_config(None, {"model": str(model), "launcher": "process"})
    rc = config.router_config(
        workers.addresses(),
        port=0,
        status_poll_interval_s=0.2,
        prefix_index=RedisIndexConfig(url=redis_url, heartbeat_s=0.2, breaker_open_s=0.3),
    )
    handle = await start_router(rc, cluster_secret=workers.internal.secret)
    await wait_until(
        lambda: all(i.resyncs >= 1 for i in handle.indexers.by_address.values()),
        10.0,
        "every prefill worker synced into the index",
    )
    return handle


async def published(handle: RouterHandle, groups: Iterable[int], timeout_s: float = 30.0) -> None:
    """Wait until the index holds each group's shared prefix (the workers publish it after the
    first request; asked of the index itself, so the router's lookup counters stay as they are)."""
    deadline = time.monotonic() + timeout_s
    for g in groups:
        chain = reusable_chain(prompt(g, 1), BLOCK)[: PREFIX // BLOCK]
        while max(
            (m.num_blocks for m in await handle.prefix_index.index.match(chain)), default=0
        ) < len(chain):
            assert time.monotonic() < deadline, f"group {g}'s prefix was never published"
            await asyncio.sleep(0.02)


async def generate(
    stub: inference_pb2_grpc.InferenceStub, key: tuple[int, int]
) -> tuple[list[int], ipb.FinalInfo]:
    req = ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=prompt(*key)),
        sampling=ipb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
    )
    tokens: list[int] = []
    final = None
    async for r in stub.Generate(req, timeout=30):
        tokens += r.token_ids
        if r.HasField("final"):
            final = r.final
    assert final is not None
    return tokens, final


def check_tokens(
    got: dict[tuple[int, int], list[int]], want: dict[tuple[int, int], list[int]]
) -> None:
    bad = {k: (v, want[k]) for k, v in got.items() if v != want[k]}
    # A differing greedy token would be a near-tie at most (batching changes float32 sums);
    # the tiny model's scaled q/k keep those rare, and none showed up in practice.
    assert not bad, f"greedy tokens differ from the engine without prefix reuse: {bad}"


def test_shared_prefixes_hit_and_outputs_are_unchanged(
    workers: ProcessWorkers,
    tiny_model_dir: Path,
    redis_server: RedisServer,
    reference: dict[tuple[int, int], list[int]],
) -> None:
    async def scenario() -> None:
        handle = await router_over(workers, tiny_model_dir, redis_server.url)
        channel = grpc.aio.insecure_channel(handle.address)
        stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        try:
            got: dict[tuple[int, int], list[int]] = {}
            finals: dict[tuple[int, int], ipb.FinalInfo] = {}
            for g in range(4):  # one request per group first: its prefix gets published
                got[(g, 0)], finals[(g, 0)] = await generate(stub, (g, 0))
            await published(handle, range(4))
            keys = [(g, i) for g in range(4) for i in range(1, 4)]
            random.Random(0).shuffle(keys)
            results = await asyncio.gather(*(generate(stub, k) for k in keys))
            for k, (tokens, final) in zip(keys, results, strict=True):
                got[k], finals[k] = tokens, final
            check_tokens(got, reference)
            for g in range(4):
                group = [finals[(g, i)] for i in range(4)]
                assert len({f.prefill_worker for f in group}) == 1, (g, group)
                assert [f.usage.cached_tokens for f in group] == [0] + [PREFIX] * 3, g
            assert len({f.prefill_worker for f in finals.values()}) == 2
            assert handle.prefix_index.stats.lookup_hits >= 12
        finally:
            await channel.close()
            await handle.stop(grace_s=0.5)

    asyncio.run(scenario())


def test_redis_killed_mid_run(
    workers: ProcessWorkers,
    tiny_model_dir: Path,
    redis_server: RedisServer,
    reference: dict[tuple[int, int], list[int]],
) -> None:
    async def scenario() -> None:
        handle = await router_over(workers, tiny_model_dir, redis_server.url)
        channel = grpc.aio.insecure_channel(handle.address)
        stub = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
        stats = handle.prefix_index.stats
        failures: list[BaseException] = []
        got: dict[tuple[int, int], list[int]] = {}

        async def client(g: int) -> None:
            for i in range(12):
                try:
                    got[(g, i)], _ = await generate(stub, (g, i))
                except grpc.aio.AioRpcError as exc:
                    failures.append(exc)

        try:
            clients = asyncio.gather(*(client(g) for g in (4, 5)))
            await wait_until(lambda: len(got) >= 4, 30.0, "traffic before the crash")
            redis_server.kill()
            await wait_until(lambda: stats.lookup_skipped > 0, 10.0, "routing without Redis")
            await asyncio.sleep(0.5)
            redis_server.start()  # back and empty
            await clients
            assert failures == [] and len(got) == 24
            check_tokens(got, reference)
            await wait_until(
                lambda: all(not i.dirty for i in handle.indexers.by_address.values()),
                10.0,
                "the index healed",
            )
            hits = stats.lookup_hits
            tokens, final = await generate(stub, (4, 0))  # its prefix is cached somewhere
            assert tokens == reference[(4, 0)]
            assert stats.lookup_hits == hits + 1 and final.usage.cached_tokens == PREFIX
        finally:
            await channel.close()
            await handle.stop(grace_s=0.5)

    asyncio.run(scenario())
