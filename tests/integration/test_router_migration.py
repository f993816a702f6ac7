"""Migration against fake workers: a request whose decode (or colocated) worker dies
mid-stream moves to another worker — prompt + tokens so far prefilled again, the sampler told
how many tokens were sampled before — and the client sees one unbroken stream, at most
`max_migrations` times.

Fake workers continue a sequence (the token after t is t + 1), so an unbroken stream is exactly
`range(first, first + max_tokens)`. Every test ends with the live workers' blocks all free.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc
import pytest

from proto.pdserve.v1 import inference_pb2 as ipb
from tests.fakes.cluster import FakeCluster, fake_cluster
from tests.fakes.fake_worker import FakeWorker, FakeWorkerConfig

PROMPT = [5, 6, 7]


def req(rid: str, max_tokens: int) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(
        request_id=rid,
        token_ids=ipb.TokenIds(ids=PROMPT),
        sampling=ipb.SamplingParams(max_tokens=max_tokens, temperature=0.7, seed=11),
    )


async def kill_holder_after(
    c: FakeCluster, workers: list[FakeWorker], rid: str, max_tokens: int, n: int
) -> tuple[list[int], ipb.FinalInfo | None, FakeWorker, grpc.aio.AioRpcError | None]:
    """Stream `rid`; after `n` tokens stop the worker holding it. (tokens, final, victim,
    error)."""
    call = c.stub.Generate(req(rid, max_tokens), timeout=10)
    tokens: list[int] = []
    while len(tokens) < n:
        resp = await call.read()
        assert resp is not grpc.aio.EOF
        tokens += resp.token_ids
    victim = next(w for w in workers if rid in w.held)
    await victim.stop()
    final = None
    try:
        while (resp := await call.read()) is not grpc.aio.EOF:
            tokens += resp.token_ids
            if resp.HasField("final"):
                final = resp.final
    except grpc.aio.AioRpcError as exc:
        return tokens, final, victim, exc
    return tokens, final, victim, None


def test_decode_worker_death_mid_stream_moves_the_request(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(tiny_model_dir, n_decode=2, worker=worker) as c:
            tokens, final, victim, err = await kill_holder_after(c, c.decode, "move", 30, 4)
            assert err is None, err
            assert tokens == list(range(8, 38)), tokens  # one unbroken stream
            assert final is not None and final.migrations == 1
            assert final.usage.completion_tokens == 30 and final.finish_reason == "length"
            survivor = next(d for d in c.decode if d is not victim)
            assert final.decode_worker == survivor.config.worker_id
            reserve, prefill = survivor.last["Reserve"], c.prefill[0].last["Prefill"]
            done = len(prefill.prompt_token_ids) - len(PROMPT)
            assert done >= 4 and list(prefill.prompt_token_ids) == PROMPT + tokens[:done]
            assert (reserve.num_prompt_tokens, reserve.max_tokens) == (3 + done, 30 - done)
            assert prefill.sampling.num_sampled == done and prefill.sampling.has_seed
            assert survivor.last["Decode"].sampling.num_sampled == done
            await c.assert_no_leaks(exclude=(victim,))

    asyncio.run(scenario())


@pytest.mark.parametrize("max_migrations", [0, 1])
def test_no_migration_left_is_unavailable(tiny_model_dir: Path, max_migrations: int) -> None:
    """max_migrations 0: no move at all; 1 with one decode worker: nowhere to move to."""

    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        n_decode = 2 if max_migrations == 0 else 1
        async with fake_cluster(
            tiny_model_dir, n_decode=n_decode, worker=worker, max_migrations=max_migrations
        ) as c:
            tokens, final, victim, err = await kill_holder_after(c, c.decode, "stuck", 30, 3)
            assert err is not None and err.code() == grpc.StatusCode.UNAVAILABLE
            assert final is None and tokens == list(range(8, 8 + len(tokens)))
            if max_migrations:
                assert "moving the request failed: no healthy decode worker" in err.details()
            assert c.prefill[0].calls["Prefill"] == 1  # no second leg
            await c.assert_no_leaks(exclude=(victim,))

    asyncio.run(scenario())


def test_colocated_worker_death_mid_stream_moves_the_request(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(tiny_model_dir, "colocated", n_colocated=2, worker=worker) as c:
            tokens, final, victim, err = await kill_holder_after(c, c.colocated, "co", 20, 3)
            assert err is None, err
            assert tokens == list(range(8, 28)) and final is not None and final.migrations == 1
            survivor = next(w for w in c.colocated if w is not victim)
            done = len(survivor.last["Generate"].prompt_token_ids) - len(PROMPT)
            assert survivor.last["Generate"].sampling.num_sampled == done >= 3
            await c.assert_no_leaks(exclude=(victim,))

    asyncio.run(scenario())


def test_a_stream_that_ends_without_finishing_moves_the_request(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_decode=2, policy="round_robin") as c:
            d0, d1 = c.decode
            d0.config.cut_stream_after = 5
            outs = [await c.generate(req(f"r{i}", 12)) for i in range(2)]  # one runs on d0
            for out in outs:
                assert [t for r in out for t in r.token_ids] == list(range(8, 20))
            final = next(o[-1].final for o in outs if o[-1].final.migrations)
            assert final.decode_worker == d1.config.worker_id
            await c.assert_no_leaks()

    asyncio.run(scenario())


async def _freeze_holder_after(
    c: FakeCluster, rid: str, n: int, status_too: bool
) -> tuple[grpc.aio.UnaryStreamCall, list[int], FakeWorker]:  # type: ignore[type-arg]
    """Stream `rid` (30 tokens); after `n` tokens freeze the decode worker holding it."""
    call = c.stub.Generate(req(rid, 30), timeout=30)
    tokens: list[int] = []
    while len(tokens) < n:
        resp = await call.read()
        assert resp is not grpc.aio.EOF
        tokens += resp.token_ids
    victim = next(w for w in c.decode if rid in w.held)
    victim.freeze(status_too)
    return call, tokens, victim


async def _rest(call: grpc.aio.UnaryStreamCall, tokens: list[int]) -> ipb.FinalInfo | None:  # type: ignore[type-arg]
    final = None
    while (resp := await call.read()) is not grpc.aio.EOF:
        tokens += resp.token_ids
        if resp.HasField("final"):
            final = resp.final
    return final


def test_a_frozen_decode_worker_s_stream_moves(tiny_model_dir: Path) -> None:
    """The worker stops mid-stream and answers nothing (SIGSTOP): after `stall_timeout_s`
    and a status call it does not answer, the request moves as from a dead worker; thawed,
    the worker gets its blocks back (the router's Abort)."""

    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(
            tiny_model_dir, n_decode=2, worker=worker, stall_timeout_s=0.3
        ) as c:
            call, tokens, victim = await _freeze_holder_after(c, "frozen", 4, status_too=True)
            final = await _rest(call, tokens)
            assert tokens == list(range(8, 38)), tokens  # one unbroken stream
            assert final is not None and final.migrations == 1
            survivor = next(d for d in c.decode if d is not victim)
            assert final.decode_worker == survivor.config.worker_id
            victim.thaw()
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_a_silent_stream_whose_worker_answers_is_kept(tiny_model_dir: Path) -> None:
    """A stream silent past `stall_timeout_s` whose worker still answers status calls (a long
    step, a queue) stays where it is."""

    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(
            tiny_model_dir,
            n_decode=2,
            worker=worker,
            stall_timeout_s=0.1,
            status_poll_interval_s=3600.0,  # only the stall watch calls GetStatus
        ) as c:
            call, tokens, victim = await _freeze_holder_after(c, "busy", 4, status_too=False)
            asked = victim.calls["GetStatus"]
            while victim.calls["GetStatus"] < asked + 2:  # the watch asked twice: it answered
                await asyncio.sleep(0.01)
            victim.thaw()
            final = await _rest(call, tokens)
            assert tokens == list(range(8, 38)), tokens
            assert final is not None and final.migrations == 0
            assert final.decode_worker == victim.config.worker_id
            await c.assert_no_leaks()

    asyncio.run(scenario())
