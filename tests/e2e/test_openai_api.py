"""The OpenAI HTTP front of a real cluster (router + prefill + decode processes, tiny model),
driven by the official `openai` client: completions and chat, streaming and not, the same
greedy text as gRPC, usage, and a client that disconnects mid-stream.

Runs in the pytest process; one cluster for the module.
"""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path

import openai
import pytest

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2
from tests.e2e.helpers import PROMPTS, E2ECluster

pytestmark = pytest.mark.slow

CASES = [p for p in PROMPTS if p.name in ("len7", "len33", "shared1", "text-short", "text-long")]


@pytest.fixture(scope="module")
def cluster(start_cluster: Callable[..., Iterator[E2ECluster]]) -> Iterator[E2ECluster]:
    yield from start_cluster("openai", "disagg", {"router.http_port": 0}, prefill=1, decode=1)


@pytest.fixture(scope="module")
def client(cluster: E2ECluster) -> Iterator[openai.OpenAI]:
    url = cluster.local.router.http_url
    assert url is not None
    with openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    (card,) = client.models.list().data
    return card.id


def grpc_text(cluster: E2ECluster, prompt: list[int] | str, max_tokens: int) -> str:
    """The greedy text of one gRPC Generate."""
    req = inference_pb2.GenerateRequest(
        sampling=inference_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0)
    )
    if isinstance(prompt, str):
        req.text = prompt
    else:
        req.token_ids.ids.extend(prompt)
    out = "".join(r.text for r in cluster.stub.Generate(req, timeout=30))
    return out


def test_completions_greedy_text_equals_grpc(
    cluster: E2ECluster, client: openai.OpenAI, model: str, tiny_model_dir: Path
) -> None:
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    for case in CASES:
        prompt: list[int] | str = case.text if case.text is not None else list(case.token_ids or ())
        want = grpc_text(cluster, prompt, case.max_tokens)
        whole = client.completions.create(
            model=model, prompt=prompt, max_tokens=case.max_tokens, temperature=0
        )
        assert whole.choices[0].text == want, case.name
        assert whole.choices[0].finish_reason == "length"
        usage = whole.usage
        assert usage is not None
        n_prompt = len(tok.encode(prompt)) if isinstance(prompt, str) else len(prompt)
        assert usage.prompt_tokens == n_prompt, case.name
        assert usage.completion_tokens == case.max_tokens
        assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
        chunks = list(
            client.completions.create(
                model=model,
                prompt=prompt,
                max_tokens=case.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want, case.name
        assert chunks[-1].choices == [] and chunks[-1].usage == usage
    cluster.wait_no_leaks()


def test_chat_streaming_and_not_agree(
    cluster: E2ECluster, client: openai.OpenAI, model: str
) -> None:
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You keep the lighthouse."},
        {"role": "user", "content": "What do you see tonight?"},
    ]
    whole = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=10,
        temperature=0,  # type: ignore[arg-type]
    )
    choice = whole.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert whole.usage is not None and whole.usage.completion_tokens == 10
    stream = client.chat.completions.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_completion_tokens=10,
        temperature=0,
        stream=True,
    )
    parts = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert "".join(parts) == choice.message.content
    cluster.wait_no_leaks()


def test_openai_client_raises_on_http_errors(client: openai.OpenAI, model: str) -> None:
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="hi", max_tokens=4, top_p=1.5)
    assert bad.value.body == {
        "message": "top_p: must be in (0, 1], got 1.5",
        "type": "invalid_request_error",
        "param": "top_p",
        "code": "invalid_argument",
    }
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="n=1"):
        client.completions.create(model=model, prompt="hi", max_tokens=4, n=2)


def test_client_disconnect_mid_stream_frees_every_workers_blocks(
    cluster: E2ECluster, model: str
) -> None:
    url = urllib.parse.urlsplit(cluster.local.router.http_url or "")
    body = {
        "model": model,
        "prompt": list(range(10, 60)),
        "max_tokens": 300,
        "ignore_eos": True,
        "stream": True,
    }
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(body))
    resp = conn.getresponse()
    assert resp.status == 200
    first = resp.readline()  # the first chunk's data line
    assert first.startswith(b"data: {")
    assert cluster.free_blocks() != cluster.baseline  # the decode worker holds the request
    conn.close()  # drop the connection mid-stream
    cluster.wait_no_leaks()


@pytest.fixture(scope="module")
def engine_logprobs(tiny_model_dir: Path) -> Callable[[list[int], int, int], object]:
    """`(prompt ids, max_tokens, k) -> RequestOutput` of the in-process engine (greedy)."""
    from model_runtime.engine import EngineConfig, LLMEngine
    from model_runtime.sampling_params import SamplingParams

    engine = LLMEngine.from_model_dir(tiny_model_dir, EngineConfig(num_kv_blocks=64))

    def run(prompt: list[int], max_tokens: int, k: int) -> object:
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=max_tokens, logprobs=k))
        return out

    return run


def test_logprobs_equal_the_engines_through_grpc_and_http(
    cluster: E2ECluster,
    client: openai.OpenAI,
    model: str,
    tiny_model_dir: Path,
    engine_logprobs: Callable[[list[int], int, int], object],
) -> None:
    from model_runtime.request import RequestOutput

    tok = Tokenizer.from_model_dir(tiny_model_dir)
    prompt = list(range(40, 75))
    want = engine_logprobs(prompt, 6, 3)
    assert isinstance(want, RequestOutput)
    want_tops = [[t for t, _ in top or ()] for top in want.output_top_logprobs]

    req = inference_pb2.GenerateRequest(
        token_ids=inference_pb2.TokenIds(ids=prompt),
        sampling=inference_pb2.SamplingParams(max_tokens=6, temperature=0.0, logprobs=3),
    )
    got = [
        (t, lp)
        for r in cluster.stub.Generate(req, timeout=30)
        for t, lp in zip(r.token_ids, r.logprobs, strict=True)
    ]
    assert [t for t, _ in got] == list(want.output_token_ids)
    assert [lp.logprob for _, lp in got] == pytest.approx(list(want.output_logprobs), abs=1e-4)
    assert [[x.token_id for x in lp.top] for _, lp in got] == want_tops

    text = tok.decode  # a token's text in the HTTP answers is its own decoding
    whole = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=3
    )
    lp = whole.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.tokens == [text([t], skip_special_tokens=False) for t in want.output_token_ids]
    assert lp.token_logprobs == pytest.approx(list(want.output_logprobs), abs=1e-4)
    for top, ids in zip(lp.top_logprobs, want_tops, strict=True):
        assert list(top) == [text([t], skip_special_tokens=False) for t in ids]
    offsets = [0]
    for t in lp.tokens[:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp.text_offset == offsets

    chat = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    entries = [
        e
        for c in chat
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content or []
    ]
    assert len(entries) == 4
    for e in entries:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.top_logprobs[0].token == e.token  # greedy: the token is the most likely one
        assert e.bytes == list(e.token.encode())
    cluster.wait_no_leaks()


def _scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_worker_and_router_metrics_move_by_the_requests_sent(
    cluster: E2ECluster, client: openai.OpenAI, model: str
) -> None:
    roles = {w.address: w.role for w in cluster.local.workers.workers}
    ports = {a: cluster.status(a).metrics_port for a in roles}
    assert all(ports.values()), ports  # every worker reports its exporter
    (p,) = [a for a in roles if roles[a] == "prefill"]
    (d,) = [a for a in roles if roles[a] == "decode"]

    def worker(address: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return _scrape(f"http://127.0.0.1:{ports[address]}/metrics")

    router_url = (cluster.local.router.http_url or "").removesuffix("/v1") + "/metrics"
    before = {p: worker(p), d: worker(d), "router": _scrape(router_url)}
    prompts = [list(range(100 + 40 * i, 100 + 40 * i + 21 + i)) for i in range(3)]
    for prompt in prompts:
        client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
    cluster.wait_no_leaks()
    after = {p: worker(p), d: worker(d), "router": _scrape(router_url)}

    def moved(where: str, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after[where].get(key, 0.0) - before[where].get(key, 0.0)

    assert moved(p, "pdserve:prompt_tokens_total") == sum(map(len, prompts))
    assert moved(p, "pdserve:prefix_cache_queries_total") == sum(map(len, prompts))
    assert moved(p, "pdserve:generation_tokens_total") == 3  # each request's first token
    assert moved(d, "pdserve:generation_tokens_total") == 3 * 4  # the rest
    assert moved(d, "pdserve:prompt_tokens_total") == 0  # the decode worker prefills nothing
    assert moved(p, "pdserve:kv_transfer_seconds_count", side="send") == 3
    assert moved(d, "pdserve:kv_transfer_seconds_count", side="recv") == 3
    assert moved(d, "pdserve:kv_transfer_bytes_total", side="recv", cache_dtype="float32") > 0
    assert (
        moved(d, "pdserve:kv_transfer_request_bytes_count", side="recv", cache_dtype="float32") == 3
    )
    for where in (p, d):
        assert after[where][("pdserve:num_requests_running", ())] == 0
        assert 0.0 <= after[where][("pdserve:kv_cache_usage_perc", ())] <= 1.0
    assert after[p][("pdserve:worker_role", (("role", "prefill"),))] == 1
    assert moved("router", "pdserve:request_success_total", finished_reason="length") == 3
    assert moved("router", "pdserve:time_to_first_token_seconds_count") == 3


def test_grpc_reflection_serves_the_api_without_proto_files(cluster: E2ECluster) -> None:
    """A generic client (as grpcurl does) learns `pdserve.v1.Inference` from the router itself
    and calls Generate with messages built from the reflected descriptors alone."""
    from google.protobuf import descriptor_pool, message_factory
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    db = ProtoReflectionDescriptorDatabase(cluster.channel)
    services = set(db.get_services())
    assert {"pdserve.v1.Inference", "grpc.health.v1.Health"} <= services
    pool = descriptor_pool.DescriptorPool(db)  # a pool of its own: nothing from inference_pb2
    method = pool.FindServiceByName("pdserve.v1.Inference").FindMethodByName("Generate")
    request_cls = message_factory.GetMessageClass(method.input_type)
    response_cls = message_factory.GetMessageClass(method.output_type)
    request = request_cls()
    request.token_ids.ids.extend([5, 6, 7])
    request.sampling.max_tokens = 3
    request.sampling.temperature = 0.0
    call = cluster.channel.unary_stream(
        "/pdserve.v1.Inference/Generate",
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )
    replies = list(call(request, timeout=30))
    assert sum(len(r.token_ids) for r in replies) == 3
    assert replies[-1].final.finish_reason == "length"
