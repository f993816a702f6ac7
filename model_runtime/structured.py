"""What a request's output must match (structured output), and its checks. Torch-free: the
router validates with it, workers compile with it (`model_runtime.grammar`).

A `StructuredOutput` is one constraint, in one of five kinds (vLLM's `structured_outputs`
names):

- ``json``: a JSON schema (the text of a JSON object), OpenAI's ``response_format:
  json_schema``; `strict` False drops keywords the grammar engine cannot enforce (OpenAI's
  non-strict mode promises nothing about them), True refuses them with a ValueError;
- ``json_object``: any JSON object (OpenAI's ``response_format: json_object``);
- ``regex``: the whole output matches a regular expression (Rust `regex` syntax, no
  look-around or back-references);
- ``choice``: the output is exactly one of a list of strings;
- ``grammar``: a Lark grammar in llguidance's dialect (which embeds JSON schemas as
  ``%json {...}``): the router builds its tool-call grammars this way.

`grammar()` turns one into the grammar engine's input (llguidance's JSON grammar format),
`check()` validates it at the edge: malformed or unsupported input raises ValueError naming the
field; size, nesting and the engine's own resource limits (`LIMITS`: lexer fuel per mask step,
lexer states, grammar size) bound what a compile and each next-token mask may cost, so a
pathological schema (deep nesting, a huge enum, an exponential regex) is refused or bounded,
never a stall.

Generated JSON ends (docs/structured-output.md, "Termination"): it is compact, with ``", "``
and ``": "`` separators and no free whitespace (a small model left free to emit whitespace can
emit it forever; xgrammar's ``any_whitespace=False``); a ``json`` schema's objects and tuples
are closed where it leaves them open (`model_runtime.closed_schema`, xgrammar's strict mode);
and the numbers of every constraint whose output is JSON (`StructuredOutput.json_output`) are
bounded in length on the worker (`model_runtime.json_numbers`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any, Literal

from model_runtime.closed_schema import closed

if TYPE_CHECKING:
    import llguidance

StructuredKind = Literal["json", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[StructuredKind, ...] = ("json", "json_object", "regex", "choice", "grammar")

MAX_SPEC_CHARS = 65536
"""Longest schema, regex, grammar, or choice list (as JSON) accepted."""
MAX_SCHEMA_DEPTH = 32
"""Deepest nesting of a JSON schema document (objects and arrays inside each other)."""
MAX_CHOICES = 1024
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""llguidance's JSON options for every generated JSON value: compact, no free whitespace."""


@cache
def limits() -> llguidance.LLParserLimits:
    """The engine's resource limits for every compile and mask (module docstring): about
    20 ms of lexer work for a compile, 10 ms per mask step at the engine's documented
    speeds, and a bounded lexer (memory ~1-2 kB per state)."""
    import llguidance

    return llguidance.LLParserLimits(
        initial_lexer_fuel=1_000_000,
        step_lexer_fuel=150_000,
        step_max_items=50_000,
        max_lexer_states=50_000,
        max_grammar_size=200_000,
    )


@dataclass(frozen=True)
class StructuredOutput:
    """One output constraint (module docstring). `spec` is the kind's text: the schema as
    JSON, the regex, the choices as a JSON list of strings, the Lark grammar; "" for
    ``json_object``. Equal constraints compile to the same grammar (the workers' cache key)."""

    kind: StructuredKind
    spec: str = ""
    strict: bool = True

    @classmethod
    def of(
        cls, kind: str, value: str | bool | list[str], lenient: bool = False
    ) -> StructuredOutput:
        """From a wire message's fields: `kind` the oneof's name, `value` its value (the list
        of choices for ``choice``; ignored for ``json_object``). ValueError for an unknown
        kind."""
        if kind not in KINDS:
            raise ValueError(f"unknown structured output kind {kind!r}; one of {list(KINDS)}")
        if kind == "json_object":
            return cls("json_object")
        if kind == "choice":
            return cls("choice", json.dumps(value))
        assert isinstance(value, str), (kind, type(value))
        return cls(kind, value, strict=not lenient)

    @property
    def json_output(self) -> bool:
        """Whether the output is JSON text, whose numbers are bounded (`json_numbers`):
        ``json``, ``json_object``, and a Lark grammar that embeds JSON (``%json``, as the
        router's tool-call grammars do)."""
        return self.kind in ("json", "json_object") or (
            self.kind == "grammar" and "%json" in self.spec
        )

    def grammar(self) -> str:
        """The constraint as llguidance's grammar text (no tokenizer needed); a ``json``
        schema closed first (`closed_schema.closed`). ValueError for a schema that is not
        JSON."""
        import llguidance

        matcher = llguidance.LLMatcher
        if self.kind == "json":
            try:
                schema = closed(json.loads(self.spec))
            except RecursionError:
                raise ValueError(f"nested deeper than {MAX_SCHEMA_DEPTH} levels") from None
            overrides: dict[str, Any] = dict(JSON_OPTIONS, lenient=not self.strict)
            return matcher.grammar_from_json_schema(json.dumps(schema), overrides=overrides)  # type: ignore[arg-type]
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            alternatives = " | ".join(json.dumps(c) for c in json.loads(self.spec))
            return matcher.grammar_from_lark(f"start: {alternatives}")
        return matcher.grammar_from_lark(self.spec)

    def check(self, field: str) -> None:
        """Raise ValueError starting with `field` when this constraint cannot be served (module
        docstring); pure apart from the engine's validation, which runs in tens of
        milliseconds at most under `limits()` (call it off any event loop)."""
        if self.kind not in KINDS:
            raise ValueError(f"{field}: unknown kind {self.kind!r}; one of {list(KINDS)}")
        if len(self.spec) > MAX_SPEC_CHARS:
            raise ValueError(
                f"{field}: {len(self.spec)} characters; at most {MAX_SPEC_CHARS} are accepted"
            )
        if self.kind == "json":
            _check_schema_document(self.spec, field)
        elif self.kind == "choice":
            _check_choices(self.spec, field)
        elif self.kind in ("regex", "grammar") and not self.spec:
            raise ValueError(f"{field}: must not be empty")
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(self.grammar(), None, limits=limits())
        if error:
            raise ValueError(f"{field}: {_one_line(error)}")


def _one_line(message: str) -> str:
    """The engine's (multi-line, caret-drawing) message on one line."""
    return " ".join(message.replace("^", " ").split())


def _depth(value: Any) -> int:
    """Nesting depth of a parsed JSON document (iterative: no recursion limit to hit)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, d = stack.pop()
        if isinstance(node, dict):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node.values())
        elif isinstance(node, list):
            deepest = max(deepest, d)
            stack.extend((v, d + 1) for v in node)
    return deepest


def _check_schema_document(spec: str, field: str) -> None:
    try:
        schema = json.loads(spec)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"{field}: not valid JSON: {exc}") from None
    if not isinstance(schema, dict | bool):
        raise ValueError(f"{field}: a JSON schema is an object, got {type(schema).__name__}")
    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise ValueError(
            f"{field}: nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are accepted"
        )


def _check_choices(spec: str, field: str) -> None:
    try:
        choices = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{field}: not a JSON list of strings: {exc}") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
        raise ValueError(f"{field}: must be a list of strings")
    if not choices or len(choices) > MAX_CHOICES:
        raise ValueError(f"{field}: 1 to {MAX_CHOICES} choices, got {len(choices)}")
    if any(c == "" for c in choices):
        raise ValueError(f"{field}: choices must not be empty strings")


def choice(options: list[str]) -> StructuredOutput:
    """A ``choice`` constraint over `options` (in this order)."""
    return StructuredOutput("choice", json.dumps(options))
