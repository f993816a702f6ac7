"""Router failure paths against fake workers: overload, cancel, deadline, worker death, health.

Each test ends with the no-leak check: every fake worker's free blocks are back to its total.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from proto.pdserve.v1 import inference_pb2 as ipb
from tests.fakes.cluster import fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorker, FakeWorkerConfig

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def req(rid: str, max_tokens: int = 200) -> ipb.GenerateRequest:
    return ipb.GenerateRequest(
        request_id=rid,
        token_ids=ipb.TokenIds(ids=[5, 6, 7]),
        sampling=ipb.SamplingParams(max_tokens=max_tokens),
    )


async def expect_status(call_coro: object, code: grpc.StatusCode) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await call_coro  # type: ignore[misc]
    assert err.value.code() == code, (err.value.code(), err.value.details())
    return err.value


def test_overload_is_refused_quickly(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.02)
        async with fake_cluster(tiny_model_dir, worker=worker, max_inflight=1, max_queued=1) as c:
            running = c.stub.Generate(req("a"), timeout=10)
            await running.read()
            queued = c.stub.Generate(req("b"), timeout=10)
            await wait_until(lambda: c.router.service.admission.queued == 1, what="b queued")
            t0 = time.perf_counter()
            err = await expect_status(c.generate(req("c")), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert time.perf_counter() - t0 < 1.0
            assert "queue full" in (err.details() or "")
            assert err.details().endswith("(request c)"), err.details()  # its own id (issue 39)
            running.cancel()
            first_of_b = await queued.read()  # b got the slot
            assert list(first_of_b.token_ids) == [8]
            queued.cancel()
            await c.assert_no_leaks()
            assert c.decode[0].calls["Reserve"] == 2  # "c" never reached a worker

    asyncio.run(scenario())


def test_client_cancel_mid_stream_aborts_and_frees(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            call = c.stub.Generate(req("bye"), timeout=10)
            for _ in range(3):
                await call.read()
            assert c.decode[0].free_blocks < c.decode[0].config.total_blocks
            call.cancel()
            assert await call.code() == grpc.StatusCode.CANCELLED
            await wait_until(lambda: "bye" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()
            assert c.router.service.admission.running == 0

    asyncio.run(scenario())


def test_client_cancel_during_prefill_aborts_prefill_and_decode(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(prefill_delay_s=5.0)
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            call = c.stub.Generate(req("early"), timeout=10)
            await wait_until(lambda: "early" in c.prefill[0].held, what="prefill started")
            call.cancel()
            await wait_until(lambda: "early" in c.prefill[0].aborts, what="Abort on P")
            await wait_until(lambda: "early" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_client_cancel_while_reserve_is_in_flight_aborts_the_reservation(
    tiny_model_dir: Path,
) -> None:
    """D has reserved but its answer has not reached the router when the client cancels: the
    router must still send D an Abort (D joins the abort list before Reserve is called)."""

    async def scenario() -> None:
        worker = FakeWorkerConfig(reserve_answer_delay_s=5.0)
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            call = c.stub.Generate(req("mid-reserve"), timeout=10)
            await wait_until(lambda: "mid-reserve" in c.decode[0].held, what="D reserved")
            call.cancel()
            await wait_until(lambda: "mid-reserve" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_client_deadline_mid_stream(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.02)
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            await expect_status(
                c.generate(req("late"), timeout=0.3), grpc.StatusCode.DEADLINE_EXCEEDED
            )
            await wait_until(lambda: "late" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_router_default_deadline_with_a_hung_prefill(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, default_timeout_s=0.4) as c:
            c.prefill[0].hang.add("Prefill")
            t0 = time.perf_counter()
            err = await expect_status(
                c.generate(req("hung"), timeout=None), grpc.StatusCode.DEADLINE_EXCEEDED
            )
            assert time.perf_counter() - t0 < 2.0, err.details()
            await wait_until(lambda: "hung" in c.prefill[0].aborts, what="Abort on P")
            await wait_until(lambda: "hung" in c.decode[0].aborts, what="Abort on D")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_decode_worker_death_mid_stream_is_unavailable(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        worker = FakeWorkerConfig(token_delay_s=0.01)
        async with fake_cluster(tiny_model_dir, worker=worker) as c:
            call = c.stub.Generate(req("orphan"), timeout=10)
            await call.read()
            await call.read()
            await c.decode[0].stop()
            with pytest.raises(grpc.aio.AioRpcError) as err:
                while await call.read() != grpc.aio.EOF:
                    pass
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
            await c.assert_no_leaks(exclude=(c.decode[0],))  # P released its blocks; D is dead
            # the router now knows D is down: new requests fail fast, without a worker call
            err2 = await expect_status(c.generate(req("next")), grpc.StatusCode.UNAVAILABLE)
            assert "no healthy decode worker" in (err2.details() or "")

    asyncio.run(scenario())


def test_unreachable_workers_are_retried_elsewhere_before_the_first_token(
    tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_prefill=2, n_decode=2, max_route_attempts=3) as c:
            c.decode[0].fail["Reserve"] = grpc.StatusCode.UNAVAILABLE
            c.prefill[0].fail["Prefill"] = grpc.StatusCode.UNAVAILABLE
            out = await c.generate(req("retry", max_tokens=4))
            assert [t for r in out for t in r.token_ids] == [8, 9, 10, 11]
            final = out[-1].final
            assert final.prefill_worker == c.prefill[1].config.worker_id
            assert final.decode_worker == c.decode[1].config.worker_id
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_kv_push_failure_blames_the_decode_worker_not_the_prefill_worker(
    tiny_model_dir: Path,
) -> None:
    """A Prefill that fails because its KV push to D failed (D died) names D in its trailer:
    the router retries on another D, the prefill worker stays healthy, health stays SERVING."""

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_decode=2, policy="round_robin") as c:
            p, (d0, d1) = c.prefill[0], c.decode
            p.kv_push_fails_to.add(d0.config.worker_id)
            for i in range(4):  # round robin: d0 is tried at least once
                out = await c.generate(req(f"ok{i}", max_tokens=3))
                assert out[-1].final.decode_worker == d1.config.worker_id
                assert c.router.pool.views("prefill")[0].healthy
                assert await c.health_status() == SERVING
            assert d0.calls["Reserve"] >= 1 and p.calls["Prefill"] > 4
            await wait_until(lambda: d0.aborts != [], what="d0's reservation aborted")

            p.kv_push_fails_to.add(d1.config.worker_id)  # no decode worker takes KV now
            err = await expect_status(c.generate(req("none")), grpc.StatusCode.UNAVAILABLE)
            # which worker failed is in the log; the client reads what failed and its request id
            assert "fake-decode" not in (err.details() or "") and "127.0.0.1" not in err.details()
            assert err.details().endswith("(request none)"), err.details()
            # the decode worker failed, not the prefill worker (issue 39)
            assert "a decode worker failed while receiving" in err.details(), err.details()
            assert "prefill worker" not in err.details(), err.details()
            assert c.router.pool.views("prefill")[0].healthy
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_prefill_failure_without_alternative_aborts_the_reservation(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            c.prefill[0].fail["Prefill"] = grpc.StatusCode.UNAVAILABLE
            await expect_status(c.generate(req("p-down")), grpc.StatusCode.UNAVAILABLE)
            assert "p-down" in c.decode[0].aborts  # awaited before the answer
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_no_decode_room_is_resource_exhausted(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, n_decode=2, policy="round_robin") as c:
            for d in c.decode:
                d.config.total_blocks = 2  # 32 tokens; requests below need 13 blocks
            err = await expect_status(c.generate(req("big")), grpc.StatusCode.RESOURCE_EXHAUSTED)
            assert "blocks" in (err.details() or "")
            assert [d.calls["Reserve"] for d in c.decode] == [1, 1]  # tried both, then gave up
            assert c.prefill[0].calls["Prefill"] == 0

    asyncio.run(scenario())


def test_health_follows_worker_availability(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(
            tiny_model_dir, status_poll_interval_s=0.1, status_poll_timeout_s=0.2
        ) as c:
            assert await c.health_status() == SERVING
            assert await c.health_status("pdserve.v1.Inference") == SERVING
            port = int(c.decode[0].address.rsplit(":", 1)[1])
            await c.decode[0].stop()
            await wait_until(
                lambda: c.router.pool.views("decode")[0].healthy is False, what="decode unhealthy"
            )
            assert await c.health_status() == NOT_SERVING
            await expect_status(c.generate(req("x")), grpc.StatusCode.UNAVAILABLE)

            revived = FakeWorker(FakeWorkerConfig(role="decode"))
            await revived.start(port=port)
            c.decode[0] = revived
            await wait_until(
                lambda: c.router.pool.views("decode")[0].healthy, 5.0, what="decode healthy again"
            )
            assert await c.health_status() == SERVING
            out = await c.generate(req("back", max_tokens=3))
            assert out[-1].final.finish_reason == "length"

            c.prefill[0].hang.add("GetStatus")  # a frozen worker: polls time out
            await wait_until(
                lambda: not c.router.pool.views("prefill")[0].healthy, what="prefill unhealthy"
            )
            assert await c.health_status() == NOT_SERVING
            c.prefill[0].hang.clear()
            await wait_until(
                lambda: c.router.pool.views("prefill")[0].healthy, what="prefill healthy"
            )
            assert await c.health_status() == SERVING

    asyncio.run(scenario())
