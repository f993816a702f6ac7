"""A corpus of JSON schemas for structured output: the schemas the validity tests and the
structured-output benchmark run (`SCHEMAS`), and small feature probes, each with one instance
that must pass and one that must fail, that measure which JSON-schema keywords a grammar
engine enforces (`FEATURES`, `benchmarks/bench_grammar_engines.py`). Torch-free; pure data.

`SCHEMAS` spans the shapes applications send: flat and nested objects, arrays with and
without bounds, enums and consts, bounded integers and numbers, optional fields, nullable
fields, `$defs` with `$ref`, `anyOf`, string patterns and lengths. Each has a user prompt that
asks for that kind of object, so a small instruct model is not fighting its prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

Schema = dict[str, Any]


@dataclass(frozen=True)
class NamedSchema:
    name: str
    schema: Schema
    prompt: str


def _obj(props: dict[str, Schema], required: list[str] | None = None) -> Schema:
    """A closed object schema (`additionalProperties: false`), all fields required unless
    `required` says otherwise."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


_S: Schema = {"type": "string", "maxLength": 40}
_INT: Schema = {"type": "integer"}

SCHEMAS: tuple[NamedSchema, ...] = (
    NamedSchema(
        "person",
        _obj({"name": _S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
        "Give a person's name and age.",
    ),
    NamedSchema(
        "city", _obj({"city": _S, "country": _S, "population": _INT}), "Describe a large city."
    ),
    NamedSchema(
        "weather",
        _obj(
            {
                "city": _S,
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "temperature": {"type": "number", "minimum": -80, "maximum": 60},
            }
        ),
        "What is the weather in Paris?",
    ),
    NamedSchema(
        "book",
        _obj(
            {
                "title": _S,
                "author": _S,
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "genres": {"type": "array", "items": _S, "maxItems": 3},
            }
        ),
        "Recommend a book.",
    ),
    NamedSchema(
        "todo",
        _obj(
            {
                "items": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj({"task": _S, "done": {"type": "boolean"}}),
                }
            }
        ),
        "Make a short to-do list for a weekend.",
    ),
    NamedSchema(
        "address",
        _obj({"street": _S, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": _S}),
        "Write a US postal address.",
    ),
    NamedSchema(
        "color",
        _obj({"name": _S, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
        "Name a color and its hex code.",
    ),
    NamedSchema(
        "sentiment",
        _obj(
            {
                "label": {"enum": ["positive", "negative", "neutral"]},
                "score": {"type": "number", "minimum": 0, "maximum": 1},
            }
        ),
        "Classify the sentiment of: 'I love this phone.'",
    ),
    NamedSchema(
        "optional_fields",
        _obj({"name": _S, "nickname": _S, "email": _S}, required=["name"]),
        "Describe a user profile; the nickname and email are optional.",
    ),
    NamedSchema(
        "nullable",
        _obj({"title": _S, "subtitle": {"type": ["string", "null"], "maxLength": 40}}),
        "Give a movie title and its subtitle, or null if it has none.",
    ),
    NamedSchema(
        "nested",
        _obj(
            {
                "company": _S,
                "ceo": _obj({"name": _S, "age": {"type": "integer", "minimum": 18, "maximum": 99}}),
                "hq": _obj({"city": _S, "country": _S}),
            }
        ),
        "Describe a famous company.",
    ),
    NamedSchema(
        "deep_nested",
        _obj({"a": _obj({"b": _obj({"c": _obj({"value": _INT})})})}),
        "Fill in a nested configuration object.",
    ),
    NamedSchema(
        "defs_ref",
        {
            "$defs": {"point": _obj({"x": _INT, "y": _INT})},
            **_obj({"start": {"$ref": "#/$defs/point"}, "end": {"$ref": "#/$defs/point"}}),
        },
        "Give the start and end points of a line segment.",
    ),
    NamedSchema(
        "defs_array",
        {
            "$defs": {"step": _obj({"explanation": _S, "output": _S})},
            **_obj(
                {
                    "steps": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/step"},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                    "final_answer": _S,
                }
            ),
        },
        "Solve 8x + 31 = 2 step by step.",
    ),
    NamedSchema(
        "any_of",
        _obj(
            {
                "id": {"anyOf": [_INT, {"type": "string", "maxLength": 12}]},
                "kind": {"enum": ["user", "group"]},
            }
        ),
        "Give an account id and whether it is a user or a group.",
    ),
    NamedSchema(
        "tagged_union",
        _obj(
            {
                "shape": {
                    "anyOf": [
                        _obj(
                            {
                                "type": {"const": "circle"},
                                "radius": {"type": "number", "minimum": 0, "maximum": 100},
                            }
                        ),
                        _obj(
                            {
                                "type": {"const": "square"},
                                "side": {"type": "number", "minimum": 0, "maximum": 100},
                            }
                        ),
                    ]
                }
            }
        ),
        "Describe a geometric shape.",
    ),
    NamedSchema(
        "const", _obj({"version": {"const": "1.0"}, "name": _S}), "Describe a software package."
    ),
    NamedSchema(
        "bool_flags",
        _obj(
            {
                "enabled": {"type": "boolean"},
                "visible": {"type": "boolean"},
                "count": {"type": "integer", "minimum": 0, "maximum": 10},
            }
        ),
        "Describe a feature toggle.",
    ),
    NamedSchema(
        "int_array",
        _obj(
            {
                "numbers": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 100},
                    "minItems": 3,
                    "maxItems": 5,
                }
            }
        ),
        "List some small numbers.",
    ),
    NamedSchema(
        "string_array",
        {"type": "array", "items": _S, "minItems": 2, "maxItems": 4},
        "List a few fruits.",
    ),
    NamedSchema("top_enum", {"enum": ["red", "green", "blue"]}, "Pick a primary color."),
    NamedSchema(
        "top_integer", {"type": "integer", "minimum": 1, "maximum": 10}, "Rate a film from 1 to 10."
    ),
    NamedSchema(
        "date_like",
        _obj({"event": _S, "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}}),
        "Name a historical event and its date.",
    ),
    NamedSchema(
        "min_length",
        _obj({"word": {"type": "string", "minLength": 3, "maxLength": 12}}),
        "Give a word.",
    ),
    NamedSchema(
        "exclusive_bounds",
        _obj({"probability": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}}),
        "Give the probability of rain tomorrow.",
    ),
    NamedSchema(
        "recipe",
        _obj(
            {
                "name": _S,
                "servings": {"type": "integer", "minimum": 1, "maximum": 12},
                "ingredients": {
                    "type": "array",
                    "minItems": 1,
                    "maxItems": 4,
                    "items": _obj(
                        {"item": _S, "grams": {"type": "integer", "minimum": 1, "maximum": 1000}}
                    ),
                },
            }
        ),
        "Write a simple recipe.",
    ),
    NamedSchema(
        "product",
        _obj(
            {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"},
                "price": {"type": "number", "minimum": 0, "maximum": 10000},
                "in_stock": {"type": "boolean"},
                "tags": {"type": "array", "items": _S, "maxItems": 3},
            },
            required=["sku", "price", "in_stock"],
        ),
        "Describe a product in a shop.",
    ),
    NamedSchema(
        "event_log",
        _obj(
            {
                "events": {
                    "type": "array",
                    "maxItems": 3,
                    "items": _obj(
                        {"level": {"enum": ["debug", "info", "warning", "error"]}, "message": _S}
                    ),
                }
            }
        ),
        "Write a few log lines.",
    ),
    NamedSchema(
        "matrix",
        _obj(
            {
                "rows": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 2,
                    "items": {"type": "array", "minItems": 2, "maxItems": 2, "items": _INT},
                }
            }
        ),
        "Give a 2x2 matrix of integers.",
    ),
    NamedSchema(
        "query",
        {
            "$defs": {
                "condition": _obj(
                    {
                        "column": _S,
                        "operator": {"enum": ["=", ">", "<", "!="]},
                        "value": {"anyOf": [_S, _INT]},
                    }
                ),
            },
            **_obj(
                {
                    "table_name": {"enum": ["orders", "customers", "products"]},
                    "columns": {
                        "type": "array",
                        "items": {"enum": ["id", "status", "shipped_at"]},
                        "maxItems": 3,
                    },
                    "conditions": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/condition"},
                        "maxItems": 2,
                    },
                    "order_by": {"enum": ["asc", "desc"]},
                }
            ),
        },
        "Look up all my orders that shipped but were not delivered.",
    ),
    NamedSchema("json_object", {"type": "object"}, "Describe yourself as a JSON object."),
    NamedSchema(
        "open_object",
        {"type": "object", "properties": {"name": _S}, "required": ["name"]},
        "Describe an animal; include its name.",
    ),
    NamedSchema(
        "pair",
        {"type": "array", "prefixItems": [_S, _INT], "items": False, "minItems": 2},
        "Give a name and a number as a pair.",
    ),
)
"""The validity corpus: 33 schemas of varied shape (module docstring)."""


@dataclass(frozen=True)
class Feature:
    """One JSON-schema feature: a schema using it, an instance it accepts, one it refuses
    (both as compact JSON text, `", "` and `": "` separators)."""

    name: str
    schema: Schema
    valid: str
    invalid: str


FEATURES: tuple[Feature, ...] = (
    Feature(
        "type object/properties/required",
        {"type": "object", "properties": {"a": _INT}, "required": ["a"]},
        '{"a": 1}',
        '{"b": 1}',
    ),
    Feature("additionalProperties false", _obj({"a": _INT}), '{"a": 1}', '{"a": 1, "b": 2}'),
    Feature("enum", {"enum": ["x", "y"]}, '"x"', '"z"'),
    Feature("const", {"const": "x"}, '"x"', '"y"'),
    Feature("integer minimum/maximum", {"type": "integer", "minimum": 5, "maximum": 9}, "7", "12"),
    Feature("number exclusiveMinimum", {"type": "number", "exclusiveMinimum": 0}, "0.5", "0"),
    Feature("multipleOf", {"type": "integer", "multipleOf": 3}, "9", "10"),
    Feature(
        "string minLength/maxLength",
        {"type": "string", "minLength": 2, "maxLength": 3},
        '"ab"',
        '"abcd"',
    ),
    Feature("string pattern", {"type": "string", "pattern": "^[a-c]+$"}, '"abc"', '"abd"'),
    Feature("format date", {"type": "string", "format": "date"}, '"2024-08-06"', '"yesterday"'),
    Feature("format email", {"type": "string", "format": "email"}, '"a@b.io"', '"not an email"'),
    Feature(
        "array minItems/maxItems",
        {"type": "array", "items": _INT, "minItems": 1, "maxItems": 2},
        "[1, 2]",
        "[1, 2, 3]",
    ),
    Feature(
        "uniqueItems", {"type": "array", "items": _INT, "uniqueItems": True}, "[1, 2]", "[1, 1]"
    ),
    Feature(
        "prefixItems (tuple)",
        {"type": "array", "prefixItems": [_INT, {"type": "string"}], "items": False},
        '[1, "a"]',
        '["a", 1]',
    ),
    Feature(
        "contains", {"type": "array", "items": _INT, "contains": {"const": 5}}, "[1, 5]", "[1, 2]"
    ),
    Feature("anyOf", {"anyOf": [_INT, {"type": "string"}]}, '"a"', "true"),
    Feature("oneOf", {"oneOf": [_INT, {"type": "string"}]}, "3", "true"),
    Feature("allOf", {"allOf": [{"type": "integer"}, {"minimum": 3}]}, "4", "2"),
    Feature(
        "$defs/$ref",
        {"$defs": {"n": _INT}, "type": "array", "items": {"$ref": "#/$defs/n"}},
        "[1]",
        '["a"]',
    ),
    Feature(
        "recursive $ref",
        {
            "$defs": {
                "node": {
                    "type": "object",
                    "properties": {
                        "v": _INT,
                        "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                    },
                    "required": ["v"],
                    "additionalProperties": False,
                }
            },
            "$ref": "#/$defs/node",
        },
        '{"v": 1, "kids": [{"v": 2}]}',
        '{"v": 1, "kids": [{"w": 2}]}',
    ),
    Feature("nullable type list", {"type": ["integer", "null"]}, "null", '"a"'),
    Feature(
        "patternProperties",
        {"type": "object", "patternProperties": {"^x": _INT}, "additionalProperties": False},
        '{"xa": 1}',
        '{"y": 1}',
    ),
    Feature("minProperties", {"type": "object", "minProperties": 1}, '{"a": 1}', "{}"),
    Feature(
        "if/then/else",
        {"type": "integer", "if": {"minimum": 5}, "then": {"maximum": 7}, "else": {"maximum": 2}},
        "6",
        "4",
    ),
    Feature("not", {"not": {"type": "string"}}, "1", '"a"'),
    Feature(
        "dependentRequired",
        {"type": "object", "properties": {"a": _INT, "b": _INT}, "dependentRequired": {"a": ["b"]}},
        '{"a": 1, "b": 2}',
        '{"a": 1}',
    ),
)
"""Feature probes for the engine comparison (`docs/structured-output.md`)."""
