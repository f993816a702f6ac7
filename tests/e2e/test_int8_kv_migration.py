"""Migration with an int8 KV cache: a 1P+2D cluster whose workers all keep int8 KV
(`engine.kv_cache_dtype = "int8"`); the decode worker holding a greedy stream is SIGKILLed
mid-stream and the request moves (prompt + tokens so far prefilled again, its KV quantized
again on the new pair, the same bytes where the K/V are the same) to the other decode worker:
one unbroken stream equal to the in-process int8 engine's undisturbed run, up to the near-tie
rule, and every live worker's blocks back. The hold-and-signal choreography is
tests/e2e/test_migration.py's (`_signal_decoder_mid_stream`).

Runs in the pytest process; one cluster for the module, stopped by PID at the end.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from deploy.client import build_request
from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.model_runner import StepInput
from model_runtime.sampling_params import SamplingParams
from tests.e2e.helpers import BLOCK, ENGINE, E2ECluster
from tests.e2e.test_migration import PROMPT, _signal_decoder_mid_stream

pytestmark = pytest.mark.slow

INT8_ENGINE = {**ENGINE, "kv_cache_dtype": "int8"}
N = 48
TIE_TOL = 0.05  # a K/V value on an int8 rounding boundary, as tests/integration/test_int8_kv.py


@pytest.fixture(scope="module")
def cluster(
    start_cluster: Callable[..., Iterator[E2ECluster]], hold_dir: Path
) -> Iterator[E2ECluster]:
    overrides: dict[str, object] = {"engine": INT8_ENGINE, "supervision.backoff_s": 0.1}
    yield from start_cluster("int8-migration", "disagg", overrides, prefill=1, decode=2)


def test_int8_greedy_stream_survives_its_decode_worker(
    cluster: E2ECluster, tiny_model_dir: Path, hold_dir: Path
) -> None:
    req = build_request(token_ids=PROMPT, max_tokens=N, temperature=0.0, ignore_eos=True)
    tokens, final = _signal_decoder_mid_stream(cluster, req, 8, hold_dir)
    assert final.migrations == 1 and final.usage.completion_tokens == N
    cfg = EngineConfig(**{**INT8_ENGINE, "enable_prefix_caching": False})  # type: ignore[arg-type]
    engine = LLMEngine.from_model_dir(tiny_model_dir, cfg)
    (want,) = engine.generate([PROMPT], SamplingParams(max_tokens=N, ignore_eos=True))
    expected = list(want.output_token_ids)
    if tokens != expected:  # only at a near-tie of the int8 engine's own logits
        i = next(k for k, (a, b) in enumerate(zip(tokens, expected, strict=True)) if a != b)
        ctx = PROMPT + expected[:i]
        table = list(range(-(-len(ctx) // BLOCK)))
        logits = engine.runner.execute([StepInput(ctx, 0, table)])[0]
        gap = float(logits.max() - logits[tokens[i]])
        assert gap <= TIE_TOL, f"token {i}: got {tokens[i]}, want {expected[i]} (gap {gap})"
