"""The OpenAI HTTP front against fake workers: raw SSE, response bodies, every error status with
its body, and a client disconnect aborting the request on every worker.

Everything (router with its HTTP front, fake workers, aiohttp client) runs on one event loop per
test, on 127.0.0.1. The fake workers' tokens are `last prompt token + 1, + 2, ...` (see
`tests.fakes.fake_worker`), so expected texts are known exactly.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2 as ipb
from router.hybrid import HybridConfig
from tests.fakes.cluster import FakeCluster, fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorkerConfig

VOCAB = 1024
PROMPT_IDS = [5, 6, 7]


def expected_tokens(last: int, n: int) -> list[int]:
    return [(last + 1 + i) % VOCAB for i in range(n)]


def sse_data(body: str) -> list[str]:
    """The `data:` payloads of an SSE body, in order; every event must be exactly one
    ``data: ...`` line followed by a blank line."""
    assert body.endswith("\n\n"), body[-40:]
    out = []
    for event in body[:-2].split("\n\n"):
        assert event.startswith("data: ") and "\n" not in event, event
        out.append(event[len("data: ") :])
    return out


def base(c: FakeCluster) -> str:
    assert c.router.http is not None
    return f"http://127.0.0.1:{c.router.http.port}"


async def post(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any] | str
) -> tuple[int, str, str]:
    """(status, content type, body text) of one POST."""
    data = body if isinstance(body, str) else json.dumps(body)
    async with session.post(url, data=data) as resp:
        return resp.status, resp.content_type, await resp.text()


def completion(**kw: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": PROMPT_IDS, "max_tokens": 5, "temperature": 0, **kw}


def _named(model_dir: Path, tmp: Path, template: bool = True) -> Path:
    """A copy of the tiny model folder named `tiny` (the served model name), optionally
    without its chat template."""
    out = tmp / "tiny"
    shutil.copytree(model_dir, out)
    if not template:
        cfg = json.loads((out / "tokenizer_config.json").read_text())
        del cfg["chat_template"]
        (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture
def model_dir(tiny_model_dir: Path, tmp_path: Path) -> Path:
    return _named(tiny_model_dir, tmp_path)


def test_completion_stream_is_openai_sse_with_usage_chunk(model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(model_dir)
    want = expected_tokens(PROMPT_IDS[-1], 5)

    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            body = completion(stream=True, stream_options={"include_usage": True})
            status, ctype, text = await post(s, base(c) + "/v1/completions", body)
            assert (status, ctype) == (200, "text/event-stream"), text
            data = sse_data(text)
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            ids = {ch["id"] for ch in chunks}
            assert len(ids) == 1 and ids.pop().startswith("cmpl-")
            for ch in chunks:
                assert ch["object"] == "text_completion" and ch["model"] == "tiny"
                assert isinstance(ch["created"], int) and "usage" in ch
            *content, usage_chunk = chunks
            assert usage_chunk["choices"] == []
            assert usage_chunk["usage"] == {
                "prompt_tokens": 3,
                "completion_tokens": 5,
                "total_tokens": 8,
                "prompt_tokens_details": {"cached_tokens": 0},
            }
            assert all(ch["usage"] is None for ch in content)
            assert "".join(ch["choices"][0]["text"] for ch in content) == tok.decode(want)
            reasons = [ch["choices"][0]["finish_reason"] for ch in content]
            assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
            assert all(ch["choices"][0]["logprobs"] is None for ch in content)
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_chat_stream_role_first_then_content_then_empty_delta(model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            body = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_completion_tokens": 4,
                "stream": True,
            }
            status, _, text = await post(s, base(c) + "/v1/chat/completions", body)
            assert status == 200, text
            data = sse_data(text)
            assert data[-1] == "[DONE]"
            chunks = [json.loads(d) for d in data[:-1]]
            assert all(ch["object"] == "chat.completion.chunk" for ch in chunks)
            assert all("usage" not in ch for ch in chunks)  # not asked for
            first, *middle, last = (ch["choices"][0] for ch in chunks)
            assert first["delta"] == {"role": "assistant", "content": ""}
            assert all(set(ch["delta"]) == {"content"} for ch in middle) and middle
            assert last["delta"] == {} and last["finish_reason"] == "length"
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_whole_answers_and_models_and_health(model_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(model_dir)

    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            status, ctype, text = await post(s, base(c) + "/v1/completions", completion())
            assert (status, ctype) == (200, "application/json"), text
            out = json.loads(text)
            assert out["object"] == "text_completion"
            assert out["choices"][0]["text"] == tok.decode(expected_tokens(7, 5))
            assert out["usage"]["completion_tokens"] == 5
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            status, _, text = await post(
                s,
                base(c) + "/v1/chat/completions",
                {
                    **body,
                    "max_tokens": 3,
                },
            )
            chat = json.loads(text)
            assert status == 200 and chat["object"] == "chat.completion", text
            assert chat["choices"][0]["message"]["role"] == "assistant"
            assert chat["choices"][0]["finish_reason"] == "length"
            # the prompt is the template's rendering, tokenized without an extra BOS
            prompt = tok.encode("<s><|user|>\nhi</s>\n<|assistant|>\n", add_bos=False)
            assert chat["usage"]["prompt_tokens"] == len(prompt)
            want = tok.decode(expected_tokens(prompt[-1], 3))
            assert chat["choices"][0]["message"]["content"] == want
            async with s.get(base(c) + "/v1/models") as r:
                models = await r.json()
            assert models["data"][0]["id"] == "tiny" and models["object"] == "list"
            assert models["data"][0]["weights"] == "float32"  # the checkpoint dtype
            async with s.get(base(c) + "/health") as r:
                assert r.status == 200
            await c.assert_no_leaks()

    asyncio.run(scenario())


BAD_BODIES: list[tuple[dict[str, Any] | str, str, str]] = [
    # (body, param, message start) -- all 400
    (completion(top_p=1.5), "top_p", "top_p: must be in (0, 1], got 1.5"),
    (completion(max_tokens=0), "max_tokens", "max_tokens: must be >= 1, got 0"),
    (completion(n=2), "n", "n: only n=1 is supported"),
    (completion(presence_penalty=0.5), "presence_penalty", "presence_penalty: not supported"),
    (completion(tools=[]), "tools", "tools: unsupported field"),
    (completion(prompt=[]), "prompt", "prompt: prompt token ids must not be empty"),
    (completion(prompt=[5, 99999]), "prompt[1]", "prompt[1]: must be in [0, 1024)"),
    (completion(prompt=["a", "b"]), "prompt", "prompt: batched prompts are not supported"),
    (completion(prompt=3), "prompt", "prompt: must be a string, a list of token ids"),
    (completion(stop=""), "stop", "stop: stop strings must not be empty"),
    (completion(stop=["x", ""]), "stop[1]", "stop[1]: stop strings must not be empty"),
    (completion(seed=-1), "seed", "seed: must be in [0, 2^63 - 1]"),
    (completion(stream_options={"include_usage": True}), "stream_options", "stream_options:"),
    (completion(max_tokens="5"), "max_tokens", "max_tokens: Input should be a valid integer"),
    ({"prompt": "hi"}, "model", "model: field required"),
    ("{not json", "", "request body is not valid JSON"),
]


def test_every_bad_body_is_a_400_naming_the_field(model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            for body, param, start in BAD_BODIES:
                status, ctype, text = await post(s, base(c) + "/v1/completions", body)
                assert (status, ctype) == (400, "application/json"), (body, text)
                err = json.loads(text)["error"]
                assert err["message"].startswith(start), (body, err)
                assert err["param"] == (param or None), (body, err)
                assert err["type"] == "invalid_request_error", err
            chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            for extra, param in (
                ({"max_completion_tokens": 0}, "max_completion_tokens"),
                ({"messages": []}, "messages"),
                ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, ""),
            ):
                status, _, text = await post(
                    s,
                    base(c) + "/v1/chat/completions",
                    {
                        **chat,
                        **extra,
                    },
                )
                err = json.loads(text)["error"]
                assert status == 400 and (not param or err["param"] == param), (extra, text)
            for w in c.workers:  # nothing reached a worker
                assert not any(w.calls[m] for m in ("Reserve", "Prefill", "Decode")), w.calls

    asyncio.run(scenario())


def test_same_validation_text_as_grpc(model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            req = ipb.GenerateRequest(
                token_ids=ipb.TokenIds(ids=PROMPT_IDS), sampling=ipb.SamplingParams(top_k=-2)
            )
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await c.generate(req)
            grpc_text = err.value.details() or ""
            _, _, text = await post(s, base(c) + "/v1/completions", completion(top_k=-2))
            http_text = json.loads(text)["error"]["message"]
            assert grpc_text == "sampling." + http_text, (grpc_text, http_text)

    asyncio.run(scenario())


def test_unknown_model_route_and_method(model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            status, _, text = await post(s, base(c) + "/v1/completions", completion(model="x"))
            err = json.loads(text)["error"]
            assert status == 404 and err["code"] == "model_not_found" and err["param"] == "model"
            status, _, text = await post(s, base(c) + "/v1/embeddings", completion())
            assert status == 404 and json.loads(text)["error"]["type"] == "not_found_error"
            async with s.get(base(c) + "/v1/completions") as r:
                assert r.status == 405 and "error" in await r.json()

    asyncio.run(scenario())


def test_chat_without_template_is_a_400_that_says_so(tiny_model_dir: Path, tmp_path: Path) -> None:
    model_dir = _named(tiny_model_dir, tmp_path, template=False)

    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}
            status, _, text = await post(s, base(c) + "/v1/chat/completions", body)
            err = json.loads(text)["error"]
            assert status == 400 and err["param"] == "messages", text
            assert "has no chat template" in err["message"]

    asyncio.run(scenario())


def test_queue_full_429_deadline_504(model_dir: Path) -> None:
    worker = FakeWorkerConfig(token_delay_s=0.02)

    async def scenario() -> None:
        async with (
            fake_cluster(model_dir, worker=worker, http_port=0, max_inflight=1, max_queued=0) as c,
            aiohttp.ClientSession() as s,
        ):
            url = base(c) + "/v1/completions"
            long = asyncio.create_task(post(s, url, completion(max_tokens=40, stream=True)))
            await wait_until(lambda: c.router.service.admission.running == 1, what="running")
            status, _, text = await post(s, url, completion())
            err = json.loads(text)["error"]
            assert status == 429 and err["type"] == "rate_limit_error", text
            assert err["code"] == "resource_exhausted" and "queue full" in err["message"]
            assert (await long)[0] == 200
            await c.assert_no_leaks()
        slow_prefill = FakeWorkerConfig(token_delay_s=0.02, prefill_delay_s=0.5)
        async with (
            fake_cluster(model_dir, worker=slow_prefill, http_port=0, default_timeout_s=0.1) as c,
            aiohttp.ClientSession() as s,
        ):
            for stream in (False, True):  # nothing was sent yet: a plain 504 either way
                status, _, text = await post(
                    s, base(c) + "/v1/completions", completion(max_tokens=40, stream=stream)
                )
                err = json.loads(text)["error"]
                assert status == 504 and err["code"] == "deadline_exceeded", text
            await c.assert_no_leaks()
        async with (
            fake_cluster(model_dir, worker=worker, http_port=0, default_timeout_s=0.2) as c,
            aiohttp.ClientSession() as s,
        ):
            # tokens were already streamed: the error is the stream's last event
            body = completion(max_tokens=40, stream=True)
            status, _, text = await post(s, base(c) + "/v1/completions", body)
            data = sse_data(text)
            assert status == 200 and data[-1] == "[DONE]"
            assert "text_completion" in data[0]
            assert json.loads(data[-2])["error"]["code"] == "deadline_exceeded"
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_no_healthy_worker_503_and_health_503(model_dir: Path) -> None:
    async def scenario() -> None:
        async with fake_cluster(model_dir, http_port=0) as c, aiohttp.ClientSession() as s:
            for w in c.decode:
                await w.stop()
            await wait_until(lambda: not c.router.pool.views("decode")[0].healthy, 5.0)
            status, _, text = await post(s, base(c) + "/v1/completions", completion())
            err = json.loads(text)["error"]
            assert status == 503 and err["code"] == "unavailable", text
            assert "no healthy decode worker" in err["message"]
            async with s.get(base(c) + "/health") as r:
                assert r.status == 503 and (await r.json())["status"] == "not_serving"

    asyncio.run(scenario())


def test_client_disconnect_mid_stream_aborts_on_every_worker(model_dir: Path) -> None:
    worker = FakeWorkerConfig(hold_streams_after=1)  # open until the client goes, any machine

    async def scenario() -> None:
        async with fake_cluster(model_dir, worker=worker, http_port=0) as c:
            async with aiohttp.ClientSession() as s:
                resp = await s.post(
                    base(c) + "/v1/completions", json=completion(max_tokens=200, stream=True)
                )
                assert resp.status == 200
                await resp.content.readuntil(b"\n\n")  # the first chunk arrived
                d = c.decode[0]
                assert d.held  # the decode worker holds the request's blocks
                resp.close()  # drop the connection mid-stream
            await wait_until(lambda: bool(c.decode[0].aborts), 3.0, "the decode Abort")
            await c.assert_no_leaks()
            await wait_until(lambda: c.router.service.admission.running == 0, 3.0)

    asyncio.run(scenario())


def test_the_answer_reports_the_prefill_path_in_its_pdserve_extension(model_dir: Path) -> None:
    """Hybrid cluster: a 3-token prompt is prefilled on the decode worker (short), a 10-token
    one on the prefill worker (long); both the whole answer and the streamed chunk with the
    finish reason say so under `pdserve`, and no other chunk carries the key."""
    local = {"prefill_path": "local", "prefill_path_reason": "short_prompt"}
    remote = {"prefill_path": "remote", "prefill_path_reason": "long_prompt"}
    long_prompt = list(range(20, 30))

    async def scenario() -> None:
        hybrid = HybridConfig(local_prefill_max_tokens=4)
        async with (
            fake_cluster(model_dir, http_port=0, hybrid=hybrid) as c,
            aiohttp.ClientSession() as s,
        ):
            for prompt, want in ((PROMPT_IDS, local), (long_prompt, remote)):
                status, _, text = await post(
                    s, base(c) + "/v1/completions", completion(prompt=prompt)
                )
                assert status == 200, text
                assert json.loads(text)["pdserve"] == want
                body = completion(
                    prompt=prompt, stream=True, stream_options={"include_usage": True}
                )
                status, _, text = await post(s, base(c) + "/v1/completions", body)
                assert status == 200, text
                chunks = [json.loads(d) for d in sse_data(text)[:-1]]
                last = [ch for ch in chunks if ch["choices"] and ch["choices"][0]["finish_reason"]]
                assert len(last) == 1 and last[0]["pdserve"] == want, chunks
                assert sum("pdserve" in ch for ch in chunks) == 1, chunks
            chat = {
                "model": "tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 3,
            }
            status, _, text = await post(s, base(c) + "/v1/chat/completions", chat)
            assert status == 200, text
            assert json.loads(text)["pdserve"] == remote  # the rendered chat prompt is long
            status, _, text = await post(
                s, base(c) + "/v1/chat/completions", {**chat, "stream": True}
            )
            chunks = [json.loads(d) for d in sse_data(text)[:-1]]
            assert [ch.get("pdserve") for ch in chunks][-1] == remote
            assert sum("pdserve" in ch for ch in chunks) == 1, chunks
            assert c.decode[0].calls["Generate"] == 2 and c.prefill[0].calls["Prefill"] == 4
            await c.assert_no_leaks()

    asyncio.run(scenario())


def test_colocated_answers_report_no_prefill_path(model_dir: Path) -> None:
    async def scenario() -> None:
        async with (
            fake_cluster(model_dir, mode="colocated", http_port=0) as c,
            aiohttp.ClientSession() as s,
        ):
            status, _, text = await post(s, base(c) + "/v1/completions", completion())
            assert status == 200, text
            assert json.loads(text)["pdserve"] == {
                "prefill_path": None,
                "prefill_path_reason": None,
            }
            await c.assert_no_leaks()

    asyncio.run(scenario())
