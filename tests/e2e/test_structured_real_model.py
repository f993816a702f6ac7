"""Structured output on the real model: SmolLM2-135M-Instruct (float32), every schema of
`tooling.json_schemas.SCHEMAS` (33 shapes: nested objects, arrays, enums, bounded numbers,
optional and nullable fields, `$defs`, `anyOf`, patterns), greedy and at temperature 0.8
(seeded): every output ends 'stop' and is JSON that validates against its schema. Finishing is
not luck: every schema of the corpus bounds its answer once the grammar has done its part
(docs/structured-output.md, "Termination": strings have a maxLength, a pattern or an enum,
arrays a maxItems, open objects are closed, numbers are bounded in length), so each answer
ends, and `MAX_TOKENS` is twice the longest one measured (195 tokens, seeds 1, 2, 3, 7).
Tool calls forced by `tool_choice` (required and named; bounded arguments, at most
`MAX_PARALLEL_CALLS` calls) parse and validate against the function's parameters.

In-process engine, all requests in one batch (the engine's continuous batching), so the
whole set costs about as many steps as its longest answer.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from model_runtime.engine import LLMEngine
from model_runtime.engine_config import EngineConfig
from model_runtime.sampling_params import SamplingParams
from model_runtime.structured import StructuredOutput
from model_runtime.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate
from router.http.protocol import ChatCompletionRequest
from router.http.tools import ToolCallParser, render_messages, tool_use
from tooling.json_schemas import SCHEMAS

pytestmark = pytest.mark.slow

MAX_TOKENS = 400  # twice the longest answer measured (module docstring)


@pytest.fixture(scope="module")
def engine(smollm2_dir: Path) -> LLMEngine:
    cfg = EngineConfig(
        dtype="float32", num_kv_blocks=2048, max_num_seqs=64, max_num_batched_tokens=4096
    )
    return LLMEngine.from_model_dir(smollm2_dir, cfg)


def _prompt(smollm2_dir: Path, messages: list[dict[str, object]]) -> list[int]:
    template = ChatTemplate.load(smollm2_dir)
    assert template is not None
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": messages})
    text = template.render(req.messages)
    return Tokenizer.from_model_dir(smollm2_dir).encode(text, add_bos=False)


def test_every_schema_validates_greedy_and_sampled(engine: LLMEngine, smollm2_dir: Path) -> None:
    tok = Tokenizer.from_model_dir(smollm2_dir)
    prompts, params, names = [], [], []
    for s in SCHEMAS:
        system = "Answer in JSON that follows this schema: " + json.dumps(s.schema)
        ids = _prompt(
            smollm2_dir,
            [{"role": "system", "content": system}, {"role": "user", "content": s.prompt}],
        )
        so = StructuredOutput("json", json.dumps(s.schema))
        for temperature in (0.0, 0.8):
            prompts.append(ids)
            params.append(
                SamplingParams(
                    max_tokens=MAX_TOKENS, temperature=temperature, seed=7, structured=so
                )
            )
            names.append((s.name, temperature))
    outs = engine.generate(prompts, params)
    failures = []
    schemas = [s.schema for s in SCHEMAS for _ in (0, 1)]
    for (name, temperature), out, schema in zip(names, outs, schemas, strict=True):
        text = tok.decode(list(out.output_token_ids))
        try:
            assert out.finish_reason == "stop", out.finish_reason
            jsonschema.validate(json.loads(text), schema)
        except (AssertionError, json.JSONDecodeError, jsonschema.ValidationError) as exc:
            failures.append(f"{name} T={temperature}: {exc!s:.200} -- {text[:200]!r}")
    assert len(outs) >= 60
    assert not failures, "\n".join(failures)
    engine.check_integrity()


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 40},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "strict": True,
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string", "maxLength": 20},
                    "destination": {"type": "string", "maxLength": 20},
                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["origin", "destination", "passengers"],
                "additionalProperties": False,
            },
        },
    },
]
QUESTIONS = [
    "What's the weather like in Paris?",
    "Find me a flight from Boston to Denver for two people.",
    "Is it cold in Oslo today?",
    "I need to fly from Rome to Madrid.",
    "What's the weather like in SF and New York?",
]


def test_required_and_named_tool_calls_parse_and_validate(
    engine: LLMEngine, smollm2_dir: Path
) -> None:
    template = ChatTemplate.load(smollm2_dir)
    assert template is not None
    tok = Tokenizer.from_model_dir(smollm2_dir)
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}  # type: ignore[index]
    prompts, params, expect = [], [], []
    for q in QUESTIONS:
        for choice in ("required", "get_weather", "search_flights"):
            body = {"model": "m", "messages": [{"role": "user", "content": q}], "tools": TOOLS}
            if choice != "required":
                body["tool_choice"] = {"type": "function", "function": {"name": choice}}
            else:
                body["tool_choice"] = "required"
            req = ChatCompletionRequest.model_validate(body)
            use = tool_use(req)
            assert use.forced is not None and use.forced.message is not None
            grammar = use.forced.message.grammar
            ids = tok.encode(
                template.render(render_messages(req.messages, use.offered)), add_bos=False
            )
            for temperature in (0.0, 0.8):
                prompts.append(ids)
                so = StructuredOutput("grammar", grammar)
                params.append(
                    SamplingParams(
                        max_tokens=MAX_TOKENS, temperature=temperature, seed=3, structured=so
                    )
                )
                expect.append(choice)
    outs = engine.generate(prompts, params)
    for choice, out in zip(expect, outs, strict=True):
        text = tok.decode(list(out.output_token_ids))
        assert out.finish_reason == "stop", (choice, text)
        content, calls = ToolCallParser().parse(text)
        assert calls and content is None, (choice, text)
        for c in calls:
            assert choice == "required" or c.function.name == choice, (choice, text)
            jsonschema.validate(json.loads(c.function.arguments), by_name[c.function.name])
