"""Closing JSON schemas before they become grammars (`model_runtime.closed_schema`): open
objects and tuples are closed where nothing else shares their instance, and left as they are
where closing could change the schema's meaning; the compiled grammar then refuses properties
the schema does not describe."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from model_runtime.closed_schema import closed
from model_runtime.grammar import GrammarError, Grammars
from model_runtime.structured import StructuredOutput
from model_runtime.tokenizer import Tokenizer

OBJ: dict[str, Any] = {"type": "object", "properties": {"a": {"type": "integer"}}}
CLOSED_OBJ = {**OBJ, "additionalProperties": False}


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        (OBJ, CLOSED_OBJ),
        ({"type": "object"}, {"type": "object", "additionalProperties": False}),
        ({"properties": {"a": {}}}, {"properties": {"a": {}}, "additionalProperties": False}),
        ({"type": ["object", "null"]}, {"type": ["object", "null"], "additionalProperties": False}),
        (
            {"type": "array", "prefixItems": [{"type": "integer"}]},
            {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        ),
        # nested: property values, items, additionalProperties schemas are their own instances
        (
            {"type": "object", "properties": {"o": OBJ}, "additionalProperties": {"items": OBJ}},
            {
                "type": "object",
                "properties": {"o": CLOSED_OBJ},
                "additionalProperties": {"items": CLOSED_OBJ},
            },
        ),
        # anyOf branches are alternatives: closed when nothing beside them constrains
        ({"anyOf": [OBJ, OBJ]}, {"anyOf": [CLOSED_OBJ, CLOSED_OBJ]}),
        # a $defs entry referenced only by plain $refs (annotations beside them are harmless)
        (
            {"$defs": {"P": OBJ}, "properties": {"p": {"$ref": "#/$defs/P", "title": "t"}}},
            {
                "$defs": {"P": CLOSED_OBJ},
                "properties": {"p": {"$ref": "#/$defs/P", "title": "t"}},
                "additionalProperties": False,
            },
        ),
    ],
)
def test_open_objects_and_tuples_are_closed(schema: Any, expected: Any) -> None:
    before = copy.deepcopy(schema)
    assert closed(schema) == expected
    assert schema == before  # the input is not modified


@pytest.mark.parametrize(
    "schema",
    [
        {**OBJ, "additionalProperties": True},
        {**OBJ, "additionalProperties": {"type": "string"}},
        {**OBJ, "patternProperties": {"^x": {}}},
        {**OBJ, "required": ["a", "b"]},  # b would become impossible
        {**OBJ, "minProperties": 2},
        {"type": "array", "prefixItems": [{}], "minItems": 2},
        {"type": "array", "prefixItems": [{}], "contains": {"type": "integer"}},
        # branches that constrain the same instance as something beside them
        {"allOf": [OBJ, {"properties": {"b": {}}}]},
        {**OBJ, "anyOf": [{"properties": {"b": {}}}]},
        {"if": OBJ, "then": {"properties": {"b": {}}}},
        # a target referenced from a place that also constrains its instance
        {
            "$defs": {"P": OBJ},
            "properties": {"p": {"$ref": "#/$defs/P", "required": ["b"]}},
            "additionalProperties": True,
        },
        {"$defs": {"P": OBJ}, "allOf": [{"$ref": "#/$defs/P"}, {"properties": {"b": {}}}]},
        # what this module does not track: the whole schema is left as it is
        {"not": {"$ref": "#/$defs/P"}, "$defs": {"P": OBJ}},
        {"properties": {"p": {"$ref": "#/properties/q"}, "q": OBJ}},
        {"properties": {"p": {"$anchor": "x", **OBJ}}},
        {"properties": {"p": {"$id": "https://example.com/p", **OBJ}}},
        # malformed: the grammar engine refuses it
        {"type": "object", "required": "not a list"},
    ],
)
def test_shared_or_untracked_places_stay_open(schema: Any) -> None:
    assert closed(schema) == schema


def test_the_corpus_closes_only_its_open_objects() -> None:
    from tooling.json_schemas import SCHEMAS

    changed = {s.name for s in SCHEMAS if closed(s.schema) != s.schema}
    assert changed == {"json_object", "open_object"}


@pytest.fixture(scope="module")
def grammars(tiny_model_dir: Path) -> tuple[Grammars, Tokenizer]:
    text = (tiny_model_dir / "tokenizer.json").read_text()
    return Grammars(text, 1024, (1,)), Tokenizer.from_model_dir(tiny_model_dir)


def test_the_grammar_refuses_undescribed_properties(grammars: tuple[Grammars, Tokenizer]) -> None:
    g, tok = grammars
    extra = tok.encode('{"a": 1, "b": 2}', add_bos=False)
    with pytest.raises(GrammarError, match="not allowed"):
        g.matcher(StructuredOutput("json", json.dumps(OBJ)), extra)
    g.matcher(StructuredOutput("json", json.dumps({**OBJ, "additionalProperties": True})), extra)
    # OpenAI's json_object is any object: not closed
    g.matcher(StructuredOutput("json_object"), extra)
