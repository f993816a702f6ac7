"""The router's `/metrics` over fake workers: scraped over HTTP, parsed with
`prometheus_client.parser`, and every per-request count moves by exactly the requests sent,
through the gRPC and the HTTP edge alike. One event loop per test, on 127.0.0.1."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from proto.pdserve.v1 import inference_pb2 as ipb
from tests.fakes.cluster import FakeCluster, fake_cluster

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def scrape(session: aiohttp.ClientSession, c: FakeCluster) -> Samples:
    assert c.router.http is not None
    async with session.get(f"http://127.0.0.1:{c.router.http.port}/metrics") as r:
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))
            out[(s.name, labels)] = s.value
    return out


def delta(after: Samples, before: Samples, name: str, **labels: str) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_counts_move_by_exactly_the_requests_sent(tiny_model_dir: Path) -> None:
    prompt = list(range(10, 50))  # two reusable blocks of 16: every request looks them up

    async def scenario() -> None:
        async with fake_cluster(tiny_model_dir, http_port=0, kv_blocks=64) as c:
            url = f"http://127.0.0.1:{c.router.http.port}/v1/completions"  # type: ignore[union-attr]
            model = tiny_model_dir.name
            async with aiohttp.ClientSession() as s:
                before = await scrape(s, c)
                for stream in (False, True, False):
                    body = {"model": model, "prompt": prompt, "max_tokens": 4, "stream": stream}
                    async with s.post(url, json=body) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
                for _ in range(2):
                    req = ipb.GenerateRequest(
                        token_ids=ipb.TokenIds(ids=prompt),
                        sampling=ipb.SamplingParams(max_tokens=4),
                    )
                    await c.generate(req)
                with pytest.raises(grpc.aio.AioRpcError):
                    await c.generate(ipb.GenerateRequest(text=""))
                async with s.post(url, json={"model": model, "prompt": "x", "top_p": 2}) as r:
                    assert r.status == 400
                after = await scrape(s, c)
        n = 5
        assert delta(after, before, "pdserve:request_success_total", finished_reason="length") == n
        assert delta(after, before, "pdserve:request_failure_total", status="INVALID_ARGUMENT") == 2
        for hist in (
            "time_to_first_token_seconds",
            "time_per_output_token_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prompt_tokens",
            "request_generation_tokens",
        ):
            want = n + 2 if hist == "e2e_request_latency_seconds" else n
            assert delta(after, before, f"pdserve:{hist}_count") == want, hist
        assert delta(after, before, "pdserve:request_prompt_tokens_sum") == n * len(prompt)
        assert delta(after, before, "pdserve:request_generation_tokens_sum") == n * 4
        assert delta(after, before, "pdserve:prefix_index_lookups_total") == n
        assert after[("pdserve:num_requests_running", ())] == 0
        assert after[("pdserve:num_workers", (("role", "prefill"), ("state", "healthy")))] == 1
        assert after[("pdserve:num_workers", (("role", "decode"), ("state", "healthy")))] == 1

    asyncio.run(scenario())
