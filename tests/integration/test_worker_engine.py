"""The engine paths disaggregated workers use, in one process on the tiny model (no gRPC).

- a "sending KV" request (`Scheduler.open_send`): a finished prefill keeps its blocks (KV
  unchanged) until the transport's result (`Scheduler.send_result`);
- `add_prefilled_request`: KV copied layer by layer from a "prefill" engine into blocks a
  "decode" engine reserved, then decoded there, gives the colocated engine's greedy tokens and
  never repeats the first token; a first token that ends the request frees the blocks at once;
  `max_num_seqs` holds prefilled requests in `ready`;
- `step(before_forward=...)`: `on_layer_done` sees every layer once, in order, for the step
  that runs a request's last prefill chunk.
Every test ends with both block pools all free and their integrity checked.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from model_runtime.engine import EngineConfig, LLMEngine
from model_runtime.sampling_params import SamplingParams
from model_runtime.scheduler import SchedulerOutput

CFG = EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=4)
PROMPTS = [[7], list(range(10, 18)), list(range(30, 100)), [5, 9, 11, 300, 2, 77, 41, 8, 19]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[LLMEngine, LLMEngine, LLMEngine]:
    """(prefill, decode, colocated reference) engines on the same weights."""
    return tuple(LLMEngine.from_model_dir(tiny_model_dir, CFG) for _ in range(3))  # type: ignore[return-value]


def _all_free(*engines: LLMEngine) -> None:
    for e in engines:
        e.check_integrity()
        assert e.block_pool.num_free == e.num_kv_blocks, e.block_pool.num_free


def _prefill(p: LLMEngine, rid: str, prompt: list[int]) -> tuple[int, list[int]]:
    """Run `prompt` on `p`, its blocks sent as transfer `rid`; return (first token, the held
    block ids)."""
    p.add_request(rid, prompt, SamplingParams(max_tokens=1))
    outs = []
    while p.has_unfinished():
        outs += p.step(_opens_sends(p))
    (out,) = outs
    assert out.finished and p.scheduler.sending[rid].request.block_ids
    return out.output_token_ids[0], list(p.scheduler.sending[rid].request.block_ids)


def _opens_sends(p: LLMEngine):  # type: ignore[no-untyped-def]
    """A `before_forward` that opens a send (transfer id = request id) in each sampling step."""

    def before_forward(scheduled: SchedulerOutput) -> None:
        for item in scheduled.items:
            if item.samples:
                p.scheduler.open_send(item.request_id, item.request_id)

    return before_forward


def _copy_kv(p: LLMEngine, d: LLMEngine, src: list[int], dst: list[int]) -> None:
    for layer in range(p.model_config.num_hidden_layers):
        data = p.runner.kv_cache.gather_layer(layer, src)
        d.runner.kv_cache.scatter_layer(layer, dst[: len(src)], data)


def test_disaggregated_paths_match_colocated(engines: tuple[LLMEngine, ...]) -> None:
    p, d, ref = engines
    max_tokens = 12
    params = SamplingParams(max_tokens=max_tokens)
    expected = [o.output_token_ids for o in ref.generate(PROMPTS, params)]
    for i, prompt in enumerate(PROMPTS):
        rid = f"r{i}"
        first, src = _prefill(p, rid, prompt)
        assert p.block_pool.num_free == p.num_kv_blocks - len(src)  # still held
        need = -(-(len(prompt) + max_tokens - 1) // CFG.block_size)
        dst = d.block_pool.allocate(need)
        assert dst is not None
        _copy_kv(p, d, src, dst)
        p.scheduler.send_result(rid)
        assert d.add_prefilled_request(rid, prompt, first, params, dst) is None
        d.check_integrity()
        tokens = [first]
        while d.has_unfinished():
            for out in d.step():
                tokens += out.new_token_ids  # never repeats `first` (length checked below)
        assert tuple(tokens) == expected[i], (i, tokens, expected[i])
    _all_free(p, d, ref)


def test_first_token_that_ends_the_request_frees_at_once(engines: tuple[LLMEngine, ...]) -> None:
    p, d, _ = engines
    prompt = PROMPTS[2]
    first, src = _prefill(p, "one", prompt)
    dst = d.block_pool.allocate(len(src))
    assert dst is not None
    _copy_kv(p, d, src, dst)
    p.scheduler.send_result("one")
    out = d.add_prefilled_request("one", prompt, first, SamplingParams(max_tokens=1), dst)
    assert out is not None and out.finished and out.finish_reason == "length"
    assert out.new_token_ids == ()
    stop = SamplingParams(max_tokens=5, stop_token_ids=(first,))
    dst = d.block_pool.allocate(len(src))
    assert dst is not None
    out = d.add_prefilled_request("two", prompt, first, stop, dst)
    assert out is not None and out.finish_reason == "stop"
    _all_free(p, d)


def test_ready_queue_respects_max_num_seqs_and_abort(engines: tuple[LLMEngine, ...]) -> None:
    _, d, _ = engines
    params = SamplingParams(max_tokens=4)
    for i in range(CFG.max_num_seqs + 2):
        blocks = d.block_pool.allocate(2)
        assert blocks is not None
        assert d.add_prefilled_request(f"q{i}", [3, 4, 5], 6, params, blocks) is None
    d.step()
    assert len(d.scheduler.running) == CFG.max_num_seqs and len(d.scheduler.ready) == 2
    d.check_integrity()
    d.abort_request(f"q{CFG.max_num_seqs + 1}")  # from `ready`
    d.abort_request("q0")  # from `running`
    d.check_integrity()
    while d.has_unfinished():
        d.step()
    _all_free(d)


def test_before_forward_sees_last_chunk_and_every_layer(engines: tuple[LLMEngine, ...]) -> None:
    p, _, _ = engines
    prompt = list(range(40, 110))  # 70 tokens: chunks of 32, 32, 6
    p.add_request("h", prompt, SamplingParams(max_tokens=1))
    seen: list[tuple[int, list[int]]] = []

    def before_forward(scheduled: SchedulerOutput):  # type: ignore[no-untyped-def]
        (item,) = scheduled.items
        layers: list[int] = []
        seen.append((len(item.token_ids), layers))
        if item.samples:
            p.scheduler.open_send("h", "t-h")
        return layers.append if item.samples else None

    while p.has_unfinished():
        p.step(before_forward)
    assert [n for n, _ in seen] == [32, 32, 6]
    assert [layers for _, layers in seen] == [[], [], [0, 1, 2, 3]]
    with pytest.raises(ValueError, match="already in use"):
        p.add_request("h", [1], SamplingParams(max_tokens=1))
    p.scheduler.send_result("h")
    with pytest.raises(KeyError):
        p.scheduler.send_result("h")
    _all_free(p)


def test_add_prefilled_rejects_bad_input_and_takes_nothing(engines: tuple[LLMEngine, ...]) -> None:
    _, d, _ = engines
    blocks = d.block_pool.allocate(1)
    assert blocks is not None
    bad = [
        ([1] * 9, 5, SamplingParams(max_tokens=2)),  # 9 tokens do not fit one block of 8
        ([1, 2], 99999, SamplingParams(max_tokens=2)),  # first token outside the vocabulary
        ([1, 2], 5, dataclasses.replace(SamplingParams(), max_tokens=2000)),  # beyond context
    ]
    for prompt, first, params in bad:
        with pytest.raises(ValueError):
            d.add_prefilled_request("bad", prompt, first, params, blocks)
    d.block_pool.free(blocks)
    _all_free(d)
