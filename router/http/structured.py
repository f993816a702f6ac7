"""OpenAI's `response_format` and vLLM's structured-output extensions -> the gRPC
`StructuredOutputs`. Runs in the router process (HTTP front), inside the request's translation.

One request carries at most one constraint, from exactly one of:

- `response_format`: ``text`` (none), ``json_object``, ``json_schema`` (its `schema`;
  `strict: true` refuses schema keywords the grammar engine cannot enforce, `strict` false or
  unset drops them, as OpenAI promises nothing about a non-strict schema);
- `structured_outputs` (vLLM's current name): ``json`` (a schema, object or JSON text),
  ``regex``, ``choice``, ``grammar`` (Lark, llguidance's dialect), ``json_object: true``;
- vLLM's older fields `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Two set at once is a 400 naming the second. The constraint itself is checked by the request
lifecycle's validation (`router.validation`, off the event loop); `Structured.rename` maps its
gRPC field path back to the OpenAI field the client used, so its 400 names that.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from proto.pdserve.v1 import inference_pb2
from router.http.errors import OpenAIError
from router.http.protocol import SamplingRequest

_GRPC = "structured_outputs"


@dataclass(frozen=True)
class Structured:
    """A request's constraint (None: none) and the OpenAI name of its gRPC field."""

    message: inference_pb2.StructuredOutputs | None
    rename: dict[str, str] = field(default_factory=dict)


def _schema_text(value: dict[str, Any] | str) -> str:
    """A schema given as an object or as JSON text (which the validation parses)."""
    return value if isinstance(value, str) else json.dumps(value)


def _candidates(req: SamplingRequest) -> list[tuple[str, str, Any, bool]]:
    """(OpenAI field, kind, value, lenient) for every constraint the request sets."""
    out: list[tuple[str, str, Any, bool]] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        out.append(("response_format", "json_object", True, False))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None:
            raise OpenAIError.invalid("response_format.json_schema", "required for json_schema")
        schema = rf.json_schema.schema_ if rf.json_schema.schema_ is not None else {}
        lenient = not rf.json_schema.strict
        out.append(("response_format.json_schema.schema", "json", schema, lenient))
    elif rf is not None and rf.json_schema is not None:
        raise OpenAIError.invalid("response_format.json_schema", "only with type json_schema")
    so = req.structured_outputs
    if so is not None:
        for kind, value in (
            ("json", so.json_),
            ("regex", so.regex),
            ("choice", so.choice),
            ("grammar", so.grammar),
            ("json_object", so.json_object),
        ):
            if value is not None and value is not False:
                out.append((f"structured_outputs.{kind}", kind, value, False))
    for name, kind in (
        ("guided_json", "json"),
        ("guided_regex", "regex"),
        ("guided_choice", "choice"),
        ("guided_grammar", "grammar"),
    ):
        value = getattr(req, name)
        if value is not None:
            out.append((name, kind, value, False))
    return out


def structured_of(req: SamplingRequest) -> Structured:
    """The request's one constraint as `StructuredOutputs` (module docstring); 400 naming the
    field when two are set."""
    found = _candidates(req)
    if not found:
        return Structured(None)
    if len(found) > 1:
        raise OpenAIError.invalid(
            found[1][0], f"set one structured-output constraint, not both {found[0][0]} and it"
        )
    name, kind, value, lenient = found[0]
    msg = inference_pb2.StructuredOutputs()
    if kind == "json":
        msg.json = _schema_text(value)
        msg.lenient = lenient
    elif kind == "json_object":
        msg.json_object = True
    elif kind == "choice":
        msg.choice.SetInParent()  # set even when empty: the validation names it then
        msg.choice.choices.extend(value)
    else:
        setattr(msg, kind, value)
    return Structured(msg, {f"{_GRPC}.{kind}": name, f"{_GRPC}.lenient": name})
