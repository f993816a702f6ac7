"""The router's per-request prefill path (`router.hybrid`) over fake workers: the load rule's
inputs as the flow feeds them, the path in each final message and in the metrics.

The prefill worker's queue is made by construction: its `Prefill` calls are held
(`FakeWorker.hold_prefills`), so the router's own in-flight prompt tokens on it are what
`prefix_policy.load_tokens` sees. Each test ends with every fake worker's blocks back.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import grpc

from proto.pdserve.v1 import inference_pb2 as ipb
from router.hybrid import HybridConfig
from router.prefix_policy import PrefixAwarePolicy
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorker


def req(rid: str) -> ipb.GenerateRequest:
    """30 prompt tokens of their own (the request id picks them): no prefix is shared, so the
    prefix policy credits no cached tokens and each prompt counts whole in the queues."""
    start = 5 + 40 * (sum(map(ord, rid)) % 20)
    return ipb.GenerateRequest(
        request_id=rid,
        token_ids=ipb.TokenIds(ids=list(range(start, start + 30))),
        sampling=ipb.SamplingParams(max_tokens=4),
    )


def worker_id(w: FakeWorker) -> str:
    """The id a fake worker reports (`GetStatus.worker_id`)."""
    return f"fake-{w.config.role}-{w.address.rpartition(':')[2]}"


def final(responses: list[ipb.GenerateResponse]) -> ipb.FinalInfo:
    assert responses and responses[-1].HasField("final"), responses
    return responses[-1].final


def counted(c: FakeCluster, path: str, reason: str) -> float:
    labels = {"model_name": c.router.config.served_model_name, "path": path, "reason": reason}
    value = c.router.metrics.registry.get_sample_value("pdserve:prefill_path_total", labels)
    assert value is not None, labels  # every (path, reason) exists from start-up
    return value


def test_a_busy_prefill_worker_sends_long_prompts_local(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=4, prefill_queue_max_tokens=50)
        async with fake_cluster(tiny_model_dir, hybrid=hybrid) as c:
            p, d = c.prefill[0], c.decode[0]
            p.hold_prefills()
            held = [asyncio.create_task(c.generate(req(f"held{i}"))) for i in range(2)]
            # 1. two 30-token prompts queue on P (held): 60 tokens > 50 from then on
            await wait_until(lambda: len(p.held) == 2, what="two prefills held on P")
            got = final(await c.generate(req("busy")))  # 2. long, but P is busy: local
            assert (got.prefill_path, got.prefill_path_reason) == ("local", "prefill_busy")
            assert got.prefill_worker == got.decode_worker == worker_id(d)
            assert d.calls["Generate"] == 1 and p.calls["Prefill"] == 2
            p.release_prefills()  # 3. the held ones went through P
            for task in held:
                info = final(await task)
                assert (info.prefill_path, info.prefill_path_reason) == ("remote", "long_prompt")
            assert counted(c, "local", "prefill_busy") == 1
            assert counted(c, "remote", "long_prompt") == 2
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_a_busy_decode_worker_keeps_short_prompts_remote(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=64, decode_queue_max_tokens=40)
        async with fake_cluster(tiny_model_dir, hybrid=hybrid) as c:
            p, d = c.prefill[0], c.decode[0]
            first = final(await c.generate(req("a")))  # 30 <= 64, D queues 0 + 30 <= 40
            assert (first.prefill_path, first.prefill_path_reason) == ("local", "short_prompt")
            d.hang.add("Generate")  # 1. the next local prefill stays queued on D
            stuck = asyncio.create_task(c.generate(req("stuck"), timeout=None))
            await wait_until(lambda: d.calls["Generate"] == 2, what="a local request on D")
            # 2. D has 30 prompt tokens in flight from this router: 30 + 30 > 40 -> via P
            got = final(await c.generate(req("b")))
            assert (got.prefill_path, got.prefill_path_reason) == ("remote", "decode_busy")
            assert p.calls["Prefill"] == 1 and d.calls["Reserve"] == 1
            stuck.cancel()  # 3. the client gives up on it: D gets the Abort
            await wait_until(lambda: "stuck" in d.aborts, what="Abort of the local request")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_a_short_prompt_spills_to_the_prefill_worker_while_d_prefills(
    tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=64)  # spill on, margin 0 (defaults)
        async with fake_cluster(tiny_model_dir, hybrid=hybrid) as c:
            p, d = c.prefill[0], c.decode[0]
            d.hang.add("Generate")  # 1. a local prefill stays queued on D
            stuck = asyncio.create_task(c.generate(req("stuck"), timeout=None))
            await wait_until(lambda: d.calls["Generate"] == 1, what="a local request on D")
            # 2. D: 30 queued + 1 request there + 30 > P: 0 + 30 -> the idle P takes it
            got = final(await c.generate(req("b")))
            assert (got.prefill_path, got.prefill_path_reason) == ("remote", "spill")
            assert got.prefill_worker == worker_id(p) and p.calls["Prefill"] == 1
            assert counted(c, "remote", "spill") == 1
            stuck.cancel()
            await wait_until(lambda: "stuck" in d.aborts, what="Abort of the local request")
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_off_by_default_never_sends_generate_to_a_decode_worker(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir) as c:
            got = final(await c.generate(req("a")))
            assert (got.prefill_path, got.prefill_path_reason) == ("remote", "off")
            assert c.decode[0].calls["Generate"] == 0
            assert counted(c, "remote", "off") == 1
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_colocated_mode_reports_no_path(tiny_model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, mode="colocated") as c:
            got = final(await c.generate(req("a")))
            assert got.prefill_path == "" and got.prefill_path_reason == ""
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_a_refused_local_generate_is_retried_on_another_decode_worker(
    tiny_model_dir: Path,
) -> None:
    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=64)
        async with fake_cluster(tiny_model_dir, n_decode=2, hybrid=hybrid) as c:
            c.decode[0].fail["Generate"] = grpc.StatusCode.UNAVAILABLE  # D0 refuses
            for i in range(4):  # whichever D the policy picks, each request ends local on D1
                got = final(await c.generate(req(f"r{i}")))
                assert got.prefill_path == "local"
                assert got.decode_worker == worker_id(c.decode[1])
            assert c.decode[1].calls["Generate"] == 4
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_a_local_request_credits_its_prefix_to_the_decode_worker(tiny_model_dir: Path) -> None:
    """The prefix-aware policy picks (P, D) and credits P with the prompt's blocks; the request
    then prefills on D (local path), so the credit must follow it to D (`prefilled_elsewhere`)
    — else same-prefix requests would be steered to P, which never saw the prompt."""

    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=64)
        async with fake_cluster(tiny_model_dir, hybrid=hybrid) as c:
            policy = c.router.service.lifecycle.policy
            assert isinstance(policy, PrefixAwarePolicy)
            p, d = c.prefill[0], c.decode[0]
            got = final(await c.generate(req("a")))  # 30 tokens: one full block of 16
            assert (got.prefill_path, got.prefill_path_reason) == ("local", "short_prompt")
            assert policy.pending.credited(worker_id(p)) == 0
            assert policy.pending.credited(worker_id(d)) == 1
            await c.assert_no_leaks()

    asyncio.run(scenario())
