"""The OpenAI Python client's own structured-output and tools examples, unmodified
(`tests/e2e/openai_examples/`, copied byte for byte), against a 1 prefill + 1 decode cluster
of SmolLM2-135M-Instruct started as `pdserve up` starts one: the router serves the model under
the name the examples ask for, and `OPENAI_BASE_URL` points the client at it.

The examples sample at OpenAI's default temperature (1.0) without a seed or a max_tokens;
`router.http_default_max_tokens` (512) bounds them (otherwise up to the rest of the 8192-token
context: minutes of CPU for a rambling 135M model). The grammar bounds what could run forever
(whitespace, numbers, undescribed properties: docs/structured-output.md, "Termination") but
not the free-form strings these schemas ask for, and at that temperature SmolLM2-135M often
writes hundreds of tokens of prose into one: measured in process, `parsing.py`'s request ran
past 512 tokens for 11 of 32 seeds (7 of those 11 finished below 1 105 tokens), the tools
request below for 7 of 32. pdserve then answers `finish_reason: "length"` and the client's own
helper raises `LengthFinishReasonError` rather than parse an incomplete object. An example
passes when it exits 0, or ends with that error and nothing else; `test_parse_with_a_seed`
runs `parsing.py`'s request through the same `parse()` seeded, where it completes, and checks
the parsed object.

`parsing_tools.py` asks with ``tool_choice`` unset (``auto``): a 135M model decides for
itself whether to call, and SmolLM2-135M answers this one in text, so the example's
``tool_calls[0]`` fails; `test_tools_example_with_required` runs the same request through the
client's own `parse()` with ``tool_choice="required"``, greedy (deterministic: the call it
makes, in 148 tokens, is the same on every run), where constrained decoding makes the call,
and its arguments parse into the example's pydantic model.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path

import openai
import pytest
from pydantic import BaseModel

from deploy.launcher import launch_local_cluster
from tests.e2e.helpers import cluster_config, pid_alive

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parent / "openai_examples"
MODEL = "gpt-4o-2024-08-06"


@pytest.fixture(scope="module")
def base_url(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    engine = {"block_size": 16, "num_kv_blocks": 256, "max_num_batched_tokens": 512}
    overrides = {
        "router.http_port": 0,
        "router.model_name": MODEL,
        "router.http_default_max_tokens": 512,
        "router.default_timeout_s": 300.0,
        "engine": engine,
    }
    config = cluster_config(smollm2_dir, "disagg", overrides, prefill=1, decode=1)
    local = launch_local_cluster(config, tmp_path_factory.mktemp("logs-examples"), port=0)
    try:
        url = local.router.http_url
        assert url is not None
        yield url
    finally:
        pids = local.pids()
        local.stop()
        assert not [p for p in pids if pid_alive(p)], "processes left after stop()"


def _run(example: str, base_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": "unused"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / example)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize("example", ["parsing.py", "parsing_stream.py", "parsing_tools_stream.py"])
def test_example_runs_unmodified(example: str, base_url: str) -> None:
    done = _run(example, base_url)
    out = f"{example}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    if done.returncode == 0:
        if example != "parsing_tools_stream.py":
            assert "answer" in done.stdout, out  # the parsed final_answer was printed
        return
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("openai.LengthFinishReasonError"), out


class Step(BaseModel):
    explanation: str
    output: str


class MathResponse(BaseModel):
    steps: list[Step]
    final_answer: str


def test_parse_with_a_seed(base_url: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        completion = c.chat.completions.parse(
            model=MODEL,
            messages=[
                {"role": "system", "content": "You are a helpful math tutor."},
                {"role": "user", "content": "solve 8x + 31 = 2"},
            ],
            response_format=MathResponse,
            temperature=1.0,
            seed=1,
        )
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, MathResponse)


class Table(StrEnum):
    orders = "orders"
    customers = "customers"
    products = "products"


class Condition(BaseModel):
    column: str
    operator: str
    value: str | int


class Query(BaseModel):
    table_name: Table
    columns: list[str]
    conditions: list[Condition]


def test_tools_example_with_required(base_url: str) -> None:
    with openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300) as c:
        completion = c.chat.completions.parse(
            model=MODEL,
            messages=[
                {
                    "role": "system",
                    "content": "You help users query for the data they are looking for by "
                    "calling the query function.",
                },
                {"role": "user", "content": "look up all my orders in november of last year"},
            ],
            tools=[openai.pydantic_function_tool(Query)],
            tool_choice="required",
            temperature=0.0,
        )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    call = (choice.message.tool_calls or [])[0]
    assert call.function.name == "Query"
    assert isinstance(call.function.parsed_arguments, Query)
