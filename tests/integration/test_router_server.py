"""Router over gRPC against fake workers: validation at the edge, streaming, stops, routing.

Everything (router, fake workers, client) runs on one event loop per test, on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import grpc
import pytest

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2 as ipb
from tests.fakes.bad_requests import BAD_REQUESTS
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorkerConfig

VOCAB = 1024
WORK_METHODS = ("Reserve", "Prefill", "Decode", "Generate", "Abort")


def expected_tokens(last_prompt_token: int, n: int) -> list[int]:
    """What the fake workers generate after a prompt ending in `last_prompt_token`."""
    return [(last_prompt_token + 1 + i) % VOCAB for i in range(n)]


def tokens_of(responses: list[ipb.GenerateResponse]) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def test_bad_inputs_get_invalid_argument_naming_the_field(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            raw = c.channel.unary_stream(
                "/pdserve.v1.Inference/Generate",
                request_serializer=None,  # send the table's wire bytes as they are
                response_deserializer=ipb.GenerateResponse.FromString,
            )
            for bad in BAD_REQUESTS:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    _ = [r async for r in raw(bad.payload, timeout=5)]
                assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, bad.name
                assert (err.value.details() or "").startswith(f"{bad.field}:"), (
                    bad.name,
                    err.value.details(),
                )
            for w in c.workers:
                assert not any(w.calls[m] for m in WORK_METHODS), (w.address, w.calls)

    asyncio.run(scenario())


def test_duplicate_in_flight_request_id(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(hold_streams_after=1)  # "same" runs until cancelled
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            req = ipb.GenerateRequest(
                request_id="same", text="hi", sampling=ipb.SamplingParams(max_tokens=200)
            )
            first = c.stub.Generate(req, timeout=10)
            await first.read()  # running now
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate(req)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "request_id: 'same' is already in flight" in (err.value.details() or "")
            first.cancel()
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_text_prompt_streams_first_token_then_text_deltas(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    prompt = tok.encode("The lazy dog")

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            req = ipb.GenerateRequest(
                request_id="r-1", text="The lazy dog", sampling=ipb.SamplingParams(max_tokens=12)
            )
            out = await c.generate(req)
            want = expected_tokens(prompt[-1], 12)
            assert tokens_of(out) == want
            assert len(out[0].token_ids) == 1  # the first token goes out on its own, at once
            assert all(r.request_id == "r-1" for r in out)
            assert "".join(r.text for r in out) == tok.decode(want)
            assert [r.HasField("final") for r in out] == [False] * (len(out) - 1) + [True]
            final = out[-1].final
            assert final.finish_reason == "length"
            assert (final.usage.prompt_tokens, final.usage.completion_tokens) == (len(prompt), 12)
            t = final.timings
            assert 0 < t.ttft_ms <= t.e2e_ms
            assert (t.prefill_queue_ms, t.prefill_compute_ms, t.kv_transfer_ms) == (0.2, 1.0, 0.3)
            assert (t.decode_admission_ms, t.first_decode_step_ms) == (0.5, 0.1)
            assert final.prefill_worker == c.prefill[0].config.worker_id
            assert final.decode_worker == c.decode[0].config.worker_id
            d = c.decode[0]
            assert d.calls["Reserve"] == d.calls["Decode"] == 1 and d.aborts == []
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_token_ids_prompt_and_default_max_tokens(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            out = await c.generate(ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[5, 1020])))
            assert tokens_of(out) == expected_tokens(1020, 16)  # wraps around the vocab
            assert out[-1].final.usage.prompt_tokens == 2
            assert len(out[0].request_id) == 32  # the router made one

    asyncio.run(scenario())


def test_stop_string_ends_with_stop_and_aborts_the_decode_worker(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    prompt = tok.encode("Once upon a time", add_bos=False)
    stream = expected_tokens(prompt[-1], 40)
    full = tok.decode(stream)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    want_text = full[: full.index(stop)]

    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.005)
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            req = ipb.GenerateRequest(
                request_id="stop-me",
                token_ids=ipb.TokenIds(ids=prompt),
                sampling=ipb.SamplingParams(max_tokens=40, stop=[stop]),
            )
            out = await c.generate(req)
            assert "".join(r.text for r in out) == want_text
            assert out[-1].final.finish_reason == "stop"
            got = tokens_of(out)
            assert got == stream[: len(got)] and len(got) < 40
            assert out[-1].final.usage.completion_tokens == len(got)
            await wait_until(lambda: "stop-me" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_stop_token_id_and_max_tokens_one(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            sp = ipb.SamplingParams(max_tokens=30, stop_token_ids=[104])
            out = await c.generate(
                ipb.GenerateRequest(token_ids=ipb.TokenIds(ids=[99]), sampling=sp)
            )
            assert tokens_of(out) == [100, 101, 102, 103, 104]
            assert out[-1].final.finish_reason == "stop"

            one = ipb.GenerateRequest(
                request_id="one",
                token_ids=ipb.TokenIds(ids=[7]),
                sampling=ipb.SamplingParams(max_tokens=1),
            )
            out = await c.generate(one)
            assert tokens_of(out) == [8] and out[-1].final.finish_reason == "length"
            assert c.decode[0].calls["Decode"] == 1  # only the first request decoded
            # the reservation made for "one" is released by an Abort, never leaked
            await wait_until(lambda: "one" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_colocated_mode(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(
            tiny_model_dir, mode="colocated", n_colocated=2, policy="round_robin"
        ) as c:
            info = await c.stub.GetModelInfo(ipb.GetModelInfoRequest(), timeout=5)
            assert info.mode == "colocated"
            for i in range(4):
                req = ipb.GenerateRequest(
                    token_ids=ipb.TokenIds(ids=[10 * i + 3]),
                    sampling=ipb.SamplingParams(max_tokens=5),
                )
                out = await c.generate(req)
                assert tokens_of(out) == expected_tokens(10 * i + 3, 5)
                final = out[-1].final
                assert final.finish_reason == "length"
                assert final.prefill_worker == final.decode_worker
            assert [w.calls["Generate"] for w in c.colocated] == [2, 2]  # round-robin
            assert not any(w.calls["Reserve"] or w.calls["Prefill"] for w in c.colocated)
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_get_model_info(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, model_name="tiny-test") as c:
            info = await c.stub.GetModelInfo(ipb.GetModelInfoRequest(), timeout=5)
            assert (info.model, info.context_length, info.vocab_size) == ("tiny-test", 1024, VOCAB)
            assert (info.mode, info.max_tokens_default) == ("disagg", 16)

    asyncio.run(scenario())


def test_get_model_info_with_a_malformed_payload_is_invalid_argument(
    tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            raw = c.channel.unary_unary(
                "/pdserve.v1.Inference/GetModelInfo",
                request_serializer=None,
                response_deserializer=ipb.ModelInfo.FromString,
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await raw(b"\x12\x05ab", timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert (err.value.details() or "").startswith("request:"), err.value.details()

    asyncio.run(scenario())


def test_a_10_mb_request_is_invalid_argument_naming_the_limit(tiny_model_dir: Path) -> None:
    """Not the transport's RESOURCE_EXHAUSTED ("larger than max"): the router reads it and
    refuses it by its size, naming the limit, without parsing or tokenizing it."""

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            limit = c.router.service.lifecycle.limits.max_request_bytes
            big = ipb.GenerateRequest(text="x" * 10_000_000)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate(big)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert f"the limit is {limit} bytes" in (err.value.details() or "")
            assert not any(w.calls["Reserve"] for w in c.workers)

    asyncio.run(scenario())


def test_text_prompts_are_tokenized_off_the_event_loop(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            tokenizer = c.router.service.lifecycle.tokenizer
            encode, threads = tokenizer.encode, []

            def recording(text: str, add_bos: bool = True) -> list[int]:
                threads.append(threading.get_ident())
                return encode(text, add_bos)

            tokenizer.encode = recording  # type: ignore[method-assign]
            out = await c.generate(ipb.GenerateRequest(text="The lazy dog"))
            assert out[-1].final.finish_reason == "length"
            assert threads and threading.get_ident() not in threads

    asyncio.run(scenario())


async def _one(c: FakeCluster, i: int, max_tokens: int) -> None:
    """One request with prompt [i]; its tokens are checked."""
    req = ipb.GenerateRequest(
        token_ids=ipb.TokenIds(ids=[i]), sampling=ipb.SamplingParams(max_tokens=max_tokens)
    )
    assert tokens_of(await c.generate(req, timeout=30.0)) == expected_tokens(i, max_tokens)


async def _concurrent(c: FakeCluster, n: int, max_tokens: int) -> None:
    reqs = [
        ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=[i]), sampling=ipb.SamplingParams(max_tokens=max_tokens)
        )
        for i in range(n)
    ]
    outs = await asyncio.gather(*(c.generate(r) for r in reqs))
    for i, out in enumerate(outs):
        assert tokens_of(out) == expected_tokens(i, max_tokens)


def test_least_load_spreads_concurrent_requests(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        # Every prefill is held until all 8 requests are routed, so all 8 are in flight
        # together by construction: the spread comes from in-flight counts, not from timing.
        async with fake_cluster(tiny_model_dir, n_prefill=2, n_decode=2) as c:
            for w in c.prefill:
                w.hold_prefills()
            calls = asyncio.gather(*(_one(c, i, 10) for i in range(8)))
            await wait_until(
                lambda: sum(w.calls["Prefill"] for w in c.prefill) == 8,
                30.0,
                "8 prefills in flight",
            )
            for w in c.prefill:
                w.release_prefills()
            await calls
            reserves = [w.calls["Reserve"] for w in c.decode]
            prefills = [w.calls["Prefill"] for w in c.prefill]
            assert sum(reserves) == sum(prefills) == 8
            assert min(reserves) >= 3 and min(prefills) >= 3, (reserves, prefills)
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_a_routed_prompt_counts_on_its_prefill_worker_before_its_reservation(
    tiny_model_dir: Path,
) -> None:
    """A prompt counts as prefill work on the worker chosen for it from the choice, not only
    once the decode worker's Reserve answers: with every Reserve held, a 64-token prompt goes
    out first, then seven 1-token ones, which must all go to the other prefill worker (counted
    late, they alternated by recency, 4 + 4: the clump a loaded machine made in
    `test_least_load_spreads_concurrent_requests`)."""

    async def one(c: FakeCluster, prompt: list[int]) -> None:
        req = ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=prompt), sampling=ipb.SamplingParams(max_tokens=4)
        )
        assert len(tokens_of(await c.generate(req, timeout=30.0))) == 4

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_prefill=2, n_decode=2) as c:
            for w in c.decode:
                w.hold_reserves()

            def reserves() -> int:
                return sum(w.calls["Reserve"] for w in c.decode)

            calls = [asyncio.create_task(one(c, list(range(3, 67))))]
            await wait_until(lambda: reserves() == 1, 30.0, "the long prompt's Reserve out")
            calls += [asyncio.create_task(one(c, [3 + i])) for i in range(7)]
            await wait_until(lambda: reserves() == 8, 30.0, "8 reservations out")
            for w in c.decode:
                w.release_reserves()
            await asyncio.gather(*calls)
            prefills = sorted(w.calls["Prefill"] for w in c.prefill)
            assert prefills == [1, 7], prefills
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_least_load_avoids_a_decode_worker_without_room(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_decode=2) as c:
            small = c.decode[0]
            small.config.total_blocks = 1  # 16 tokens: too small for any request below
            await c.router.pool.poll_once()
            await _concurrent(c, 4, 20)
            assert small.calls["Reserve"] == 0 and c.decode[1].calls["Reserve"] == 4

    asyncio.run(scenario())


def test_draining_and_removed_workers_get_no_new_work(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_decode=3, policy="round_robin") as c:
            c.decode[0].draining = True
            await c.router.pool.poll_once()
            assert await c.router.pool.remove(c.decode[1].address) is True
            assert [v.address for v in c.router.pool.views("decode")] == sorted(
                [c.decode[0].address, c.decode[2].address]  # views are sorted by address
            )
            await _concurrent(c, 3, 4)
            assert [d.calls["Reserve"] for d in c.decode] == [0, 0, 3]
            assert await c.router.pool.remove(c.decode[1].address) is False

    asyncio.run(scenario())


def test_colocated_stop_string_aborts_the_worker(tiny_model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    full = tok.decode(expected_tokens(300, 30))
    stop = full[10:13]

    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.005)
        async with fake_cluster(tiny_model_dir, mode="colocated", worker=worker) as c:
            req = ipb.GenerateRequest(
                request_id="co-stop",
                token_ids=ipb.TokenIds(ids=[300]),
                sampling=ipb.SamplingParams(max_tokens=30, stop=[stop]),
            )
            out = await c.generate(req)
            assert "".join(r.text for r in out) == full[: full.index(stop)]
            assert out[-1].final.finish_reason == "stop"
            await wait_until(lambda: "co-stop" in c.colocated[0].aborts, what="Abort on W")
            await c.assert_no_leaks()

    asyncio.run(scenario())
