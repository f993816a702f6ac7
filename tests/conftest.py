"""Shared pytest fixtures for every test tier (runs in the pytest process).

`tiny_model_dir` builds the tiny random Llama model (`model_runtime.random_model`, preset
"tiny", seed 0) once per session into a temporary folder: config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json. It takes well under a second.
Tests must treat the folder as read-only; a test that needs a modified model builds its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Path of the session's tiny random model folder (seed 0)."""
    from model_runtime.random_model import make_random_model

    return make_random_model(tmp_path_factory.mktemp("tiny_model"), "tiny", seed=0)
