"""The int8 KV cache end to end: a 1P1D cluster with `engine.kv_cache_dtype = "int8"` on both
workers gives the in-process colocated int8 engine's greedy tokens, token for token, over the
fidelity prompt set (block boundaries, long prompts, shared prefixes, text), one request at a
time in the same order (so both see the same prefix-cache hits) and on one torch thread as the
workers run: the transfer moves the quantized blocks and their scales as stored, so nothing
about the KV changes on the way. The decode worker's metrics count each request's KV bytes
under `cache_dtype="int8"`: exactly the int8 blocks' bytes, and no block leaks.

Runs in the pytest process; one cluster for the module.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache
from tests.e2e.helpers import BLOCK, ENGINE, PROMPTS, E2ECluster

pytestmark = pytest.mark.slow

INT8_ENGINE = {**ENGINE, "kv_cache_dtype": "int8"}


@pytest.fixture(scope="module")
def cluster(start_cluster: Callable[..., Iterator[E2ECluster]]) -> Iterator[E2ECluster]:
    yield from start_cluster("int8-1p1d", "disagg", {"engine": INT8_ENGINE}, prefill=1, decode=1)


def colocated_int8_tokens(model_dir: Path) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Greedy tokens and prompt lengths of every prompt through an in-process colocated engine
    with the cluster's engine config, one request at a time, in order, on one thread."""
    from model_runtime.engine import EngineConfig, LLMEngine
    from model_runtime.sampling_params import SamplingParams
    from model_runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_model_dir(model_dir)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = LLMEngine.from_model_dir(model_dir, EngineConfig(**INT8_ENGINE))  # type: ignore[arg-type]
        assert engine.runner.kv_cache.cache_dtype == "int8"
        tokens, lengths = {}, {}
        for p in PROMPTS:
            ids = list(p.token_ids) if p.token_ids is not None else tok.encode(p.text or "")
            (res,) = engine.generate([ids], SamplingParams(max_tokens=p.max_tokens))
            tokens[p.name], lengths[p.name] = list(res.output_token_ids), len(ids)
        return tokens, lengths
    finally:
        torch.set_num_threads(threads)


def _transfer_metrics(url: str) -> dict[tuple[str, str, str], float]:
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return {
        (s.name, s.labels.get("side", ""), s.labels.get("cache_dtype", "")): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name.startswith("pdserve:kv_transfer_")
    }


def test_disaggregated_int8_equals_colocated_int8_token_for_token(
    cluster: E2ECluster, tiny_model_dir: Path
) -> None:
    want, lengths = colocated_int8_tokens(tiny_model_dir)
    (decode,) = [w.address for w in cluster.local.workers.workers if w.role == "decode"]
    port = cluster.status(decode).metrics_port
    url = f"http://127.0.0.1:{port}/metrics"
    before = _transfer_metrics(url)
    got: dict[str, list[int]] = {}
    for p in PROMPTS:
        tokens, final = cluster.generate(p.request())
        assert final.prefill_path == "remote", (p.name, final)
        got[p.name] = tokens
    bad = {name: (got[name], want[name]) for name in want if got[name] != want[name]}
    assert not bad, f"{len(bad)} of {len(want)} prompts differ: {bad}"
    cluster.wait_no_leaks()
    # Each request's KV crossed as int8 blocks with their scales: ceil(n / block) blocks of
    # every layer, `block_bytes` each (values + float16 scales).
    config = ModelConfig.from_model_dir(tiny_model_dir)
    per_block = KVCache.bytes_per_block(config, BLOCK, torch.float32, "int8")
    sent = sum(-(-n // BLOCK) * per_block for n in lengths.values())
    after = _transfer_metrics(url)

    def moved(name: str) -> float:
        key = (name, "recv", "int8")
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert moved("pdserve:kv_transfer_bytes_total") == sent
    assert moved("pdserve:kv_transfer_request_bytes_count") == len(PROMPTS)
    assert moved("pdserve:kv_transfer_request_bytes_sum") == sent
