"""The OpenAI front's structured output and tools, without a cluster: request fields ->
`StructuredOutputs` (one constraint, the field named on conflicts), `tool_choice` -> prompt
and call grammar, and the tool-call parser (whole and streamed, cut-off blocks stay
content)."""

from __future__ import annotations

import copy
import json
from typing import Any

import llguidance
import pytest
from tokenizers import Tokenizer

from router.http.errors import OpenAIError
from router.http.protocol import ChatCompletionRequest, ChatDelta, ToolCallDelta
from router.http.structured import structured_of
from router.http.tools import CLOSE, OPEN, ToolCallParser, call_deltas, render_messages, tool_use

WEATHER: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}


def chat(**kw: object) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def test_response_format_and_vllm_names_map_to_one_constraint() -> None:
    schema = {"type": "object"}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema, "strict": True}}
    s = structured_of(chat(response_format=rf))
    assert s.message is not None and json.loads(s.message.json) == schema
    assert not s.message.lenient
    assert s.rename["structured_outputs.json"] == "response_format.json_schema.schema"
    lenient = structured_of(chat(response_format={**rf, "json_schema": {"name": "x"}}))
    assert lenient.message is not None and lenient.message.lenient
    assert structured_of(chat(response_format={"type": "json_object"})).message.json_object  # type: ignore[union-attr]
    assert structured_of(chat(response_format={"type": "text"})).message is None
    assert structured_of(chat(guided_regex="a+")).message.regex == "a+"  # type: ignore[union-attr]
    choice = structured_of(chat(structured_outputs={"choice": ["a", "b"]})).message
    assert choice is not None and list(choice.choice.choices) == ["a", "b"]
    with pytest.raises(OpenAIError, match=r"^guided_choice: set one"):
        structured_of(chat(response_format={"type": "json_object"}, guided_choice=["a"]))


def test_tool_choice() -> None:
    assert tool_use(chat()).offered == []
    assert tool_use(chat(tools=[WEATHER], tool_choice="none")).offered == []
    auto = tool_use(chat(tools=[WEATHER]))
    assert auto.parse and auto.forced is None and len(auto.offered) == 1
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        forced = tool_use(chat(tools=[WEATHER], tool_choice=choice)).forced
        assert forced is not None and forced.message is not None and forced.message.grammar
    with pytest.raises(OpenAIError, match=r"^tool_choice\.function\.name: 'nope'"):
        tool_use(chat(tools=[WEATHER], tool_choice={**named, "function": {"name": "nope"}}))
    with pytest.raises(OpenAIError, match=r"^tool_choice: "):
        tool_use(chat(tool_choice="required"))


def test_call_grammar_accepts_valid_calls_only(smollm2_tokenizer: Tokenizer) -> None:
    tok = llguidance.LLTokenizer(smollm2_tokenizer.to_str(), eos_token=2)

    def accepts(tool: dict[str, Any], s: str) -> bool:
        forced = tool_use(chat(tools=[tool], tool_choice="required")).forced
        assert forced is not None and forced.message is not None
        grammar = llguidance.LLMatcher.grammar_from_lark(forced.message.grammar)
        m = llguidance.LLMatcher(tok, grammar, log_level=0)
        ids = smollm2_tokenizer.encode(s, add_special_tokens=False).ids
        return bool(m.consume_tokens(ids)) and m.is_accepting()

    good = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    assert accepts(WEATHER, f"{OPEN}[{good}]{CLOSE}")
    assert accepts(WEATHER, f"{OPEN}[{good}, {good}]{CLOSE}")  # parallel_tool_calls defaults on
    assert not accepts(WEATHER, f"{OPEN}[{good.replace('c', 'k', 1)}]{CLOSE}")  # not in the enum
    assert not accepts(WEATHER, f'{OPEN}[{{"name": "other", "arguments": {{}}}}]{CLOSE}')
    assert not accepts(WEATHER, "Sure! " + OPEN)
    # parameters that leave other properties open are closed (model_runtime.closed_schema)
    open_tool: dict[str, Any] = copy.deepcopy(WEATHER)
    del open_tool["function"]["parameters"]["additionalProperties"]
    extra = good.replace('"c"}', '"c", "note": "hi"}')
    assert accepts(open_tool, f"{OPEN}[{good}]{CLOSE}")
    assert not accepts(open_tool, f"{OPEN}[{extra}]{CLOSE}")


@pytest.fixture(scope="module")
def smollm2_tokenizer(smollm2_dir: object) -> Tokenizer:
    from pathlib import Path

    return Tokenizer.from_file(str(Path(str(smollm2_dir)) / "tokenizer.json"))


def test_parser_whole_and_streamed() -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Let me check. {OPEN}[{call}]{CLOSE}"
    content, calls = ToolCallParser().parse(text)
    assert content == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    # streamed in awkward pieces: tags split across deltas; same result
    p = ToolCallParser()
    released, found = "", []
    for i in range(0, len(text), 3):
        piece, new = p.push(text[i : i + 3])
        released += piece
        found += new
    released += p.finish()
    assert released == "Let me check. " and [c.function.name for c in found] == ["get_weather"]
    deltas = call_deltas(found, 0)
    assert ChatDelta(tool_calls=deltas).model_dump() == {
        "tool_calls": [
            {
                "index": 0,
                "id": found[0].id,
                "type": "function",
                "function": {"name": "get_weather", "arguments": ""},
            },
            {"index": 0, "function": {"arguments": found[0].function.arguments}},
        ]
    }
    assert isinstance(deltas[0], ToolCallDelta)
    # Hermes' single-object form parses too; a block cut off by max_tokens stays content
    assert len(ToolCallParser().parse(f"{OPEN}{call}{CLOSE}")[1]) == 1
    cut = f"{OPEN}[{call[:20]}"
    assert ToolCallParser().parse(cut) == (cut, [])
    # a block that is not a call is content
    assert ToolCallParser().parse(f"{OPEN}hello{CLOSE}")[1] == []


def test_history_renders_for_a_template_without_tools() -> None:
    req = chat(
        tools=[WEATHER],
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C"},
        ],
    )
    out = render_messages(req.messages, tool_use(req).offered)
    assert [m.role for m in out] == ["system", "user", "assistant", "user"]
    assert "get_weather" in out[0].text() and out[0].text().endswith("Be brief.")
    assert (
        out[2].text()
        == f'{OPEN}[{{"name": "get_weather", "arguments": {{"city": "Paris"}}}}]{CLOSE}'
    )
    assert out[3].text() == "<tool_response>\n18 C\n</tool_response>"
