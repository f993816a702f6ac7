"""A worker that stops answering (as SIGSTOP would) at any phase of a request, over fake
workers: the request moves to other workers within the stall timeout, never waiting out its
deadline (`router.freeze_watch`).

Phases: `Reserve` on the frozen decode worker; `Prefill` whose KV push goes into a decode
worker frozen after its `Reserve` answered; a hybrid decode worker's local prefill
(`Generate` before its first chunk); `Decode` before its first token. Each phase is reached by
construction, never by timing: the router polls no status after start-up (it keeps believing
the frozen worker healthy, so it routes to it; round-robin picks it first), prefills are held
(`hold_prefills`) until the freeze is in place, and the fake's `freeze()` holds every call.

Each request has 30 s to run and the stall timeout is 0.5 s: a request that waited on the
frozen worker for its deadline fails DEADLINE_EXCEEDED. After the thaw, the router's aborts
reach the frozen worker and every worker's blocks come back.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from proto.pdserve.v1 import inference_pb2 as ipb
from router.hybrid import HybridConfig
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorker

PROMPT = [5, 6, 7]
STALL_S = 0.5
DEADLINE_S = 30.0


def req(rid: str, max_tokens: int = 6) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(
        request_id=rid,
        token_ids=ipb.TokenIds(ids=PROMPT),
        sampling=ipb.SamplingParams(max_tokens=max_tokens),
    )


@asynccontextmanager
async def cluster(tiny_model_dir: Path, **kw: Any) -> AsyncIterator[FakeCluster]:
    async with fake_cluster(
        tiny_model_dir,
        n_decode=2,
        policy="round_robin",
        stall_timeout_s=STALL_S,
        status_poll_interval_s=3600.0,  # health as at start-up: the frozen worker stays chosen
        abort_timeout_s=DEADLINE_S,  # an Abort to the frozen worker lands after the thaw
        **kw,
    ) as c:
        yield c


def first_decoder(c: FakeCluster) -> FakeWorker:
    """The decode worker round-robin picks first (lowest address)."""
    return min(c.decode, key=lambda w: w.address)


async def run(c: FakeCluster, request: ipb.GenerateRequest) -> tuple[list[int], ipb.FinalInfo]:
    out = await c.generate(request, timeout=DEADLINE_S)
    tokens = [t for r in out for t in r.token_ids]
    assert out[-1].HasField("final"), out
    return tokens, out[-1].final


async def finish(c: FakeCluster, frozen: FakeWorker) -> None:
    """Thaw the frozen worker; every worker's blocks come back (the router aborted it)."""
    frozen.thaw()
    await c.assert_no_leaks(timeout_s=DEADLINE_S)


def test_reserve_on_a_frozen_decode_worker_moves(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with cluster(tiny_model_dir) as c:
            victim = first_decoder(c)
            survivor = next(d for d in c.decode if d is not victim)
            victim.freeze()
            tokens, final = await run(c, req("reserve"))
            assert tokens == list(range(8, 14)) and final.migrations == 0
            assert final.decode_worker == survivor.config.worker_id
            assert victim.calls["Reserve"] == 1 and survivor.calls["Reserve"] == 1
            view = next(v for v in c.router.pool.views("decode") if v.address == victim.address)
            assert not view.healthy  # the watch's status call marked it
            await finish(c, victim)

    asyncio.run(scenario())


def test_a_prefill_pushing_into_a_frozen_decode_worker_moves(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with cluster(tiny_model_dir) as c:
            p = c.prefill[0]
            victim = first_decoder(c)
            survivor = next(d for d in c.decode if d is not victim)
            p.hold_prefills()
            task = asyncio.create_task(run(c, req("push")))
            # 1. Reserve answered on the victim, the Prefill holds its blocks on P
            await wait_until(lambda: "push" in p.held, DEADLINE_S, "the prefill to be held")
            assert "push" in victim.held
            # 2. the victim freezes; P's push into it is stuck from now on
            victim.freeze()
            p.stall_kv_push_to(victim.config.worker_id)
            p.release_prefills()
            tokens, final = await task
            assert tokens == list(range(8, 14)) and final.migrations == 0
            assert final.decode_worker == survivor.config.worker_id
            assert p.calls["Prefill"] == 2  # the stuck one, then the one into the survivor
            assert "push" in p.aborts  # the stuck prefill was aborted on P
            await finish(c, victim)

    asyncio.run(scenario())


def test_a_frozen_prefill_worker_is_left(tiny_model_dir: Path) -> None:
    """The Prefill's own worker freezes: the request moves to the other prefill worker."""

    async def scenario() -> None:
        async with cluster(tiny_model_dir, n_prefill=2) as c:
            victim = min(c.prefill, key=lambda w: w.address)
            survivor = next(p for p in c.prefill if p is not victim)
            victim.freeze()
            tokens, final = await run(c, req("prefill"))
            assert tokens == list(range(8, 14)) and final.migrations == 0
            assert final.prefill_worker == survivor.config.worker_id
            await finish(c, victim)

    asyncio.run(scenario())


def test_a_frozen_hybrid_decode_worker_s_local_prefill_moves(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=64, spill_to_prefill=False)
        async with cluster(tiny_model_dir, hybrid=hybrid) as c:
            victim = first_decoder(c)
            survivor = next(d for d in c.decode if d is not victim)
            victim.freeze()
            tokens, final = await run(c, req("local"))
            assert tokens == list(range(8, 14)) and final.migrations == 0
            assert final.prefill_path == "local"
            assert final.decode_worker == survivor.config.worker_id
            assert victim.calls["Generate"] == 1 and survivor.calls["Generate"] == 1
            await finish(c, victim)

    asyncio.run(scenario())


def test_a_decode_worker_frozen_before_its_first_token_moves(tiny_model_dir: Path) -> None:
    """The Prefill answered (the client has its first token); the decode worker's `Decode`
    never brings one: the request migrates with that one token kept."""

    async def scenario() -> None:
        async with cluster(tiny_model_dir) as c:
            p = c.prefill[0]
            victim = first_decoder(c)
            victim.hang.add("Decode")  # the Decode call reaches it and gets nothing
            task = asyncio.create_task(run(c, req("first")))
            await wait_until(lambda: victim.calls["Decode"] == 1, DEADLINE_S, "the Decode call")
            victim.freeze()
            tokens, final = await task
            assert tokens == list(range(8, 14)) and final.migrations == 1
            assert p.calls["Prefill"] == 2  # the prompt + the first token, prefilled again
            victim.hang.clear()
            await finish(c, victim)

    asyncio.run(scenario())


def test_a_busy_decode_worker_keeps_a_held_reserve(tiny_model_dir: Path) -> None:
    """A Reserve that takes longer than the stall timeout on a worker that answers its status
    calls (busy, not frozen) is kept: the request runs there, on its first try."""

    async def scenario() -> None:
        async with cluster(tiny_model_dir) as c:
            victim = first_decoder(c)
            victim.hold_reserves()
            task = asyncio.create_task(run(c, req("busy")))
            asked = victim.calls["GetStatus"]
            # the watch asked twice and was answered: two stall periods went by
            await wait_until(
                lambda: victim.calls["GetStatus"] >= asked + 2, DEADLINE_S, "two status calls"
            )
            victim.release_reserves()
            tokens, final = await task
            assert tokens == list(range(8, 14))
            assert final.decode_worker == victim.config.worker_id
            assert victim.calls["Reserve"] == 1 and sum(d.calls["Reserve"] for d in c.decode) == 1
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_many_requests_on_a_frozen_worker_share_one_status_call(tiny_model_dir: Path) -> None:
    """Twenty requests reserve on the frozen worker at once: one status probe judges it for
    all of them (`WorkerPool.answers` is one call per worker), and each moves."""

    async def scenario() -> None:
        async with cluster(tiny_model_dir, max_route_attempts=3) as c:
            victim = first_decoder(c)
            victim.freeze()
            asked = victim.calls["GetStatus"]
            start = time.monotonic()
            outs = await asyncio.gather(*(run(c, req(f"many{i}")) for i in range(20)))
            for tokens, final in outs:
                assert tokens == list(range(8, 14)), tokens
                assert final.decode_worker != victim.config.worker_id
            assert victim.calls["Reserve"] >= 1
            # far fewer status calls than requests reserved there (calls count on arrival)
            assert victim.calls["GetStatus"] - asked <= 2, victim.calls["GetStatus"] - asked
            assert time.monotonic() - start < DEADLINE_S
            await finish(c, victim)

    asyncio.run(scenario())
