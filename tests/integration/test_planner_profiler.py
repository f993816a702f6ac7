"""`pdserve profile`'s measurements on the tiny model: the shapes it reports are the shapes it
ran, and the engine it drives ends clean (no request left, every KV block free)."""

from __future__ import annotations

from pathlib import Path

from tooling.planner.profiler import (
    _engine,
    decode_headroom,
    measure_decode,
    measure_prefill,
    profile_engine,
)

BATCHES = (1, 2, 4)
CONTEXTS = (16, 48)


def test_decode_samples_cover_every_batch_and_context_and_free_everything(
    tiny_model_dir: Path,
) -> None:
    chunk, steps, repeats = 64, 2, 2
    headroom = decode_headroom(BATCHES, CONTEXTS, chunk, steps, repeats)
    engine = _engine(tiny_model_dir, chunk, max(BATCHES), 64)
    free = engine.block_pool.num_free
    samples = measure_decode(engine, BATCHES, CONTEXTS, steps, repeats, 256, headroom)
    assert not engine.has_unfinished() and engine.block_pool.num_free == free
    assert [b for b, _, _ in samples] == [1, 1, 2, 2, 4, 4]
    for b, context, seconds in samples:
        assert seconds > 0
        # b requests of one prompt length each, plus what they decoded so far (< headroom)
        low = b * min(CONTEXTS)
        assert low < context < b * (max(CONTEXTS) + headroom), (b, context)
    by_batch = {b: sorted(c for bb, c, _ in samples if bb == b) for b in BATCHES}
    for b, (short, long) in by_batch.items():
        assert long - short >= b * (CONTEXTS[1] - CONTEXTS[0]) - b  # one sample per context


def test_prefill_samples_are_the_chunks_of_each_prompt(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, 32, 4, 64)
    samples = measure_prefill(engine, (16, 80), 32, 1, 256)
    assert [(s, k) for s, k, _ in samples] == [(0, 16), (0, 32), (32, 32), (64, 16)]
    assert not engine.has_unfinished() and engine.block_pool.num_free == 64


def test_profile_fits_a_cost_model_from_its_samples(tiny_model_dir: Path) -> None:
    cost = profile_engine(
        tiny_model_dir,
        chunk=64,
        max_prompt=96,
        max_batch=4,
        max_context=48,
        decode_steps=2,
        repeats=1,
    )
    meta = cost.meta
    assert meta["threads"] == 1 and meta["chunk"] == 64
    assert {b for b, _, _ in meta["decode_samples"]} == {1, 2, 4}
    assert {k for _, k, _ in meta["prefill_samples"]} >= {16, 32, 64}
    assert cost.decode_s(4, 4 * 48) >= cost.decode_s(1, 48) > 0
