"""Prefix-aware routing through the real router (in this process) over fake workers whose fake
prefix caches publish KV events over gRPC (`StreamKVEvents` / `GetKVSnapshot`): in-memory
index, a Redis index shared by two router replicas, and Redis killed mid-run."""

from __future__ import annotations

import asyncio
import random
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import inference_pb2 as ipb
from proto.pdserve.v1 import inference_pb2_grpc
from router.app import start_router
from router.prefix_index.config import RedisIndexConfig
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorkerConfig
from tooling.redis_server import SKIP_REASON, RedisServer, redis_server_path

PREFIX, SUFFIX = 64, 8  # tokens; 4 shared blocks of 16 per group
ROOMY = FakeWorkerConfig(total_blocks=1024)  # every request of a burst fits on the decode side


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    if redis_server_path() is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def prompt(group: int, i: int) -> list[int]:
    rng = random.Random(group)
    shared = [rng.randrange(10, 1000) for _ in range(PREFIX)]
    return shared + [(group * 31 + i * 7 + k) % 990 + 10 for k in range(SUFFIX)]


def request(group: int, i: int) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=prompt(group, i)),
        sampling=ipb.SamplingParams(max_tokens=2, temperature=0.0),
    )


async def final(stub: inference_pb2_grpc.InferenceStub, req: ipb.GenerateRequest) -> ipb.FinalInfo:
    out = [r async for r in stub.Generate(req, timeout=10)]
    assert out[-1].HasField("final")
    return out[-1].final


async def synced(c: FakeCluster) -> None:
    await wait_until(
        lambda: all(i.resyncs >= 1 for i in c.router.indexers.by_address.values()),
        5.0,
        "every indexer's first sync",
    )


async def indexed(c: FakeCluster) -> None:
    """Every event each prefill worker has published so far is in the router's index (its
    indexer applied up to the worker's latest seq, or resynced past it)."""

    def caught_up() -> bool:
        by_address = c.router.indexers.by_address
        return all(
            w.kv is None
            or (not by_address[w.address].dirty and by_address[w.address].next_seq > w.kv.seq)
            for w in c.prefill
        )

    await wait_until(caught_up, 10.0, "the stored events to reach the index")


async def run_groups(
    c: FakeCluster, groups: range, per_group: int
) -> dict[int, list[ipb.FinalInfo]]:
    """Each group's first request alone (its prefix gets published), then the rest at once."""
    stub = c.stub
    out: dict[int, list[ipb.FinalInfo]] = defaultdict(list)
    for g in groups:
        out[g].append(await final(stub, request(g, 0)))
    await indexed(c)
    reqs = [(g, i) for g in groups for i in range(1, per_group)]
    random.Random(0).shuffle(reqs)
    finals = await asyncio.gather(*(final(stub, request(g, i)) for g, i in reqs))
    for (g, _), f in zip(reqs, finals, strict=True):
        out[g].append(f)
    return out


def test_same_prefix_lands_on_the_worker_that_holds_it(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(
            tiny_model_dir, n_prefill=2, n_decode=1, kv_blocks=256, worker=ROOMY
        ) as c:
            await synced(c)
            by_group = await run_groups(c, range(6), 4)
            for g, finals in by_group.items():
                assert len({f.prefill_worker for f in finals}) == 1, (g, finals)
                assert finals[0].usage.cached_tokens == 0
                assert all(f.usage.cached_tokens == PREFIX for f in finals[1:]), g
            used = {f.prefill_worker for fs in by_group.values() for f in fs}
            assert len(used) == 2, "groups spread over both prefill workers"
            stats = c.router.prefix_index.stats
            assert stats.lookup_hits >= 18 and stats.lookup_errors == 0
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_policies_that_ignore_prefixes_skip_the_lookup(tiny_model_dir: Path) -> None:
    """round_robin with an index configured: no lookup round trip per request (the policy would
    not read it), while the workers' own prefix caches still report their hits."""

    async def scenario() -> None:
        async with fake_cluster(
            tiny_model_dir, n_prefill=2, n_decode=1, kv_blocks=256, worker=ROOMY,
            policy="round_robin",
        ) as c:  # fmt: skip
            await synced(c)
            by_group = await run_groups(c, range(2), 4)
            assert c.router.prefix_index.stats.lookups == 0
            finals = [f for fs in by_group.values() for f in fs]
            assert len({f.prefill_worker for f in finals}) == 2, "round-robin uses both"
            assert any(f.usage.cached_tokens == PREFIX for f in finals)
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_router_replicas_share_what_they_learn(
    tiny_model_dir: Path, redis_server: RedisServer
) -> None:
    async def scenario() -> None:
        index = RedisIndexConfig(url=redis_server.url, heartbeat_s=0.2)
        async with fake_cluster(
            tiny_model_dir, n_prefill=2, n_decode=1, kv_blocks=256, worker=ROOMY, prefix_index=index
        ) as c:
            second = await start_router(c.router.config.model_copy(update={"port": 0}))
            channel = grpc.aio.insecure_channel(second.address)
            try:
                stub_b = inference_pb2_grpc.InferenceStub(channel)  # type: ignore[no-untyped-call]
                await synced(c)
                first = {g: await final(c.stub, request(g, 0)) for g in range(4)}
                await indexed(c)  # router A wrote them to the shared Redis index
                for g in range(4):  # replica B never saw these prefixes but finds them in Redis
                    f = await final(stub_b, request(g, 1))
                    assert f.prefill_worker == first[g].prefill_worker, g
                    assert f.usage.cached_tokens == PREFIX, g
                assert second.prefix_index.stats.lookup_hits == 4
            finally:
                await channel.close()
                await second.stop(grace_s=0.2)

    asyncio.run(scenario())


def test_redis_killed_mid_run_fails_nothing_and_heals(
    tiny_model_dir: Path, redis_server: RedisServer
) -> None:
    async def scenario() -> None:
        index = RedisIndexConfig(url=redis_server.url, heartbeat_s=0.1, breaker_open_s=0.2)
        worker = FakeWorkerConfig(total_blocks=1024, prefill_delay_s=0.005)
        async with fake_cluster(
            tiny_model_dir, n_prefill=2, n_decode=1, kv_blocks=256, worker=worker,
            prefix_index=index,
        ) as c:  # fmt: skip
            await synced(c)
            stats = c.router.prefix_index.stats
            failures: list[BaseException] = []
            done = 0

            async def client(k: int) -> None:
                nonlocal done
                for i in range(30):
                    try:
                        await final(c.stub, request(k % 4, 100 * k + i))
                        done += 1
                    except grpc.aio.AioRpcError as exc:
                        failures.append(exc)
                    await asyncio.sleep(0.01)

            clients = asyncio.gather(*(client(k) for k in range(4)))
            await wait_until(lambda: done >= 20, 10.0, "traffic before the crash")
            redis_server.kill()
            await wait_until(lambda: stats.lookup_skipped > 0, 5.0, "breaker open")
            skipped_at_crash = stats.lookup_skipped
            await asyncio.sleep(0.3)
            redis_server.start()  # empty: indexers must resync every worker
            await clients
            assert failures == [] and done == 120
            assert stats.lookup_skipped > skipped_at_crash or stats.lookup_errors > 0
            await wait_until(
                lambda: all(not i.dirty for i in c.router.indexers.by_address.values()),
                5.0,
                "indexers resynced into the new Redis",
            )
            hits_before = stats.lookup_hits
            by_group = await run_groups(c, range(4), 3)
            assert stats.lookup_hits >= hits_before + 8  # routing uses the index again
            for g, finals in by_group.items():
                assert all(f.usage.cached_tokens == PREFIX for f in finals), g
            await c.assert_no_leaks()

    asyncio.run(scenario())
