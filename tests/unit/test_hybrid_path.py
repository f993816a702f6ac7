"""`router.hybrid`: the per-request prefill path rule, its config and its place in the configs."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from router.config import RouterConfig
from router.hybrid import REASONS, HybridConfig, PathChoice, choose_prefill_path, indexed_tokens
from router.prefix_index.base import PrefixMatch

ON = HybridConfig(local_prefill_max_tokens=64)


def choose(config: HybridConfig, prompt: int, **kw: int) -> PathChoice:
    args = {"cached_on_decode": 0, "cached_on_prefill": 0}
    args |= {"prefill_queued_tokens": 0, "decode_queued_tokens": 0, "decode_running": 0} | kw
    return choose_prefill_path(config, prompt, **args)


def test_off_by_default_sends_everything_to_the_prefill_worker() -> None:
    assert not HybridConfig().enabled
    assert choose(HybridConfig(), 3) == PathChoice("remote", "off", 3)
    assert choose(HybridConfig(), 3, cached_on_prefill=2) == PathChoice("remote", "off", 1)


def test_the_threshold_counts_the_tokens_the_decode_worker_must_compute() -> None:
    assert choose(ON, 64) == PathChoice("local", "short_prompt", 64)
    assert choose(ON, 65) == PathChoice("remote", "long_prompt", 65)
    # 200 tokens of which D holds 150: only 50 to compute there -> local
    assert choose(ON, 200, cached_on_decode=150) == PathChoice("local", "short_prompt", 50)
    # the prefill worker's cache does not make a long prompt local; it prices the remote path
    assert choose(ON, 200, cached_on_prefill=190) == PathChoice("remote", "long_prompt", 10)


def test_a_busy_prefill_side_sends_long_prompts_local_too() -> None:
    cfg = HybridConfig(local_prefill_max_tokens=64, prefill_queue_max_tokens=1000)
    assert choose(cfg, 500, prefill_queued_tokens=1000).reason == "long_prompt"
    assert choose(cfg, 500, prefill_queued_tokens=1001) == PathChoice("local", "prefill_busy", 500)
    assert choose(ON, 500, prefill_queued_tokens=10**6).path == "remote"  # rule off: 0


def test_a_busy_decode_worker_keeps_even_short_prompts_remote() -> None:
    cfg = HybridConfig(
        local_prefill_max_tokens=64,
        prefill_queue_max_tokens=10,
        decode_queue_max_tokens=100,
        spill_to_prefill=False,
    )
    assert choose(cfg, 40, decode_queued_tokens=60) == PathChoice("local", "short_prompt", 40)
    assert choose(cfg, 40, decode_queued_tokens=61) == PathChoice("remote", "decode_busy", 40)
    busy_both = choose(cfg, 500, prefill_queued_tokens=10**6, decode_queued_tokens=0)
    assert busy_both == PathChoice("remote", "decode_busy", 500)  # D's limit wins


def test_a_short_prompt_spills_to_a_prefill_worker_with_less_work() -> None:
    # idle cluster: a tie stays local
    assert choose(ON, 31) == PathChoice("local", "short_prompt", 31)
    # the burst: D already prefills 24 tokens, P nothing -> the idle P takes the next one
    assert choose(ON, 31, decode_queued_tokens=24) == PathChoice("remote", "spill", 31)
    # each request decoding on D counts as one prompt token of its next step
    assert choose(ON, 31, decode_running=1).reason == "spill"
    assert choose(ON, 31, decode_running=8, prefill_queued_tokens=8).reason == "short_prompt"
    # P busier than D: local
    assert choose(ON, 31, decode_queued_tokens=24, prefill_queued_tokens=40).path == "local"
    # D's cache makes the local side cheaper: 60 tokens of which D holds 50
    assert choose(ON, 60, cached_on_decode=50, decode_queued_tokens=40).path == "local"
    # the margin: the hop's price in prefill tokens
    hop = HybridConfig(local_prefill_max_tokens=64, spill_margin_tokens=10)
    assert choose(hop, 31, decode_running=10).reason == "short_prompt"
    assert choose(hop, 31, decode_running=11).reason == "spill"
    # off: the threshold alone decides
    off = HybridConfig(local_prefill_max_tokens=64, spill_to_prefill=False)
    assert choose(off, 31, decode_queued_tokens=10**6, decode_running=99).reason == "short_prompt"


def test_every_reason_is_declared_for_its_path() -> None:
    cases = [
        choose(HybridConfig(), 10),
        choose(ON, 10),
        choose(ON, 100),
        choose(HybridConfig(local_prefill_max_tokens=1, prefill_queue_max_tokens=1), 9,
               prefill_queued_tokens=2),
        choose(HybridConfig(local_prefill_max_tokens=1, decode_queue_max_tokens=1), 9),
        choose(ON, 10, decode_queued_tokens=100),
    ]  # fmt: skip
    assert {(c.path, c.reason) for c in cases} == {
        (p, r) for p, reasons in REASONS.items() for r in reasons
    }


def test_indexed_tokens_reads_only_the_workers_own_current_match() -> None:
    matches = (PrefixMatch("d0", 7, 5), PrefixMatch("d0", 6, 9), PrefixMatch("p0", 1, 9))
    assert indexed_tokens("d0", 7, 16, 8, matches, 200) == 80
    assert indexed_tokens("d0", 7, 16, 3, matches, 200) == 48  # capped by the chain
    assert indexed_tokens("d0", 7, 16, 8, matches, 50) == 49  # one token always runs
    assert indexed_tokens("d1", 7, 16, 8, matches, 200) == 0
    assert indexed_tokens("d0", 7, 16, 8, None, 200) == 0  # the index did not answer


def test_config_sections(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="local_prefill_max_tokens"):
        HybridConfig(local_prefill_max_tokens=-1)
    rc = RouterConfig(model_dir=tmp_path, prefill_addrs=("a:1",), decode_addrs=("b:2",), hybrid=ON)
    assert (
        rc.hybrid.enabled and not RouterConfig(**{**rc.model_dump(), "hybrid": {}}).hybrid.enabled
    )
    with pytest.raises(ValidationError, match="needs mode 'disagg'"):
        RouterConfig(model_dir=tmp_path, mode="colocated", colocated_addrs=("c:3",), hybrid=ON)
