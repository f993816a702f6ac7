"""Structured-output constraints at the edge (`model_runtime.structured`) and their grammar
state on a worker (`model_runtime.grammar`): checks name the field, pathological input is
refused or bounded, the LRU is bounded, matchers rebuilt from tokens agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from model_runtime.grammar import GrammarError, Grammars
from model_runtime.structured import (
    MAX_SCHEMA_DEPTH,
    MAX_SPEC_CHARS,
    StructuredOutput,
    choice,
)
from model_runtime.tokenizer import Tokenizer

FIELD = "response_format.json_schema.schema"


def _json(schema: object, strict: bool = True) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema), strict)


def test_valid_constraints_pass() -> None:
    for so in (
        _json({"type": "object", "properties": {"a": {"type": "integer"}}}),
        StructuredOutput("json_object"),
        StructuredOutput("regex", "[0-9]{3}"),
        choice(["yes", "no", 'say "hi"\n']),
        StructuredOutput("grammar", 'start: "a" | "b"'),
    ):
        so.check("f")


@pytest.mark.parametrize(
    ("so", "message"),
    [
        (StructuredOutput("json", "{not json"), "not valid JSON"),
        (StructuredOutput("json", "[1, 2]"), "a JSON schema is an object"),
        (_json({"type": "foo"}), "foo"),
        (_json({"type": "array", "uniqueItems": True}), "uniqueItems"),
        (StructuredOutput("regex", "(?=a)b"), "look-around"),
        (StructuredOutput("regex", ""), "must not be empty"),
        (StructuredOutput("choice", "[]"), "1 to"),
        (StructuredOutput("choice", '["a", 1]'), "list of strings"),
        (StructuredOutput("grammar", "start: nothing_defined"), "nothing_defined"),
    ],
)
def test_bad_constraints_name_the_field(so: StructuredOutput, message: str) -> None:
    with pytest.raises(ValueError, match=rf"^{re.escape(FIELD)}: .*{message}"):
        so.check(FIELD)


def test_lenient_json_drops_what_strict_refuses() -> None:
    schema = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    _json(schema, strict=False).check(FIELD)
    with pytest.raises(ValueError, match="uniqueItems"):
        _json(schema, strict=True).check(FIELD)


def test_pathological_schemas_are_refused() -> None:
    deep: dict[str, object] = {"type": "integer"}
    for _ in range(MAX_SCHEMA_DEPTH):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(ValueError, match=r"nested .* levels deep"):
        _json(deep).check(FIELD)
    huge = _json({"enum": [f"value-{i}" for i in range(20000)]})
    assert len(huge.spec) > MAX_SPEC_CHARS
    with pytest.raises(ValueError, match=rf"at most {MAX_SPEC_CHARS}"):
        huge.check(FIELD)


def test_exponential_regex_compiles_bounded(tiny_model_dir: Path) -> None:
    """Regexes that blow up a backtracking or eagerly built DFA engine compile lazily here;
    their masks are computed under the step fuel limit."""
    grammars = _grammars(tiny_model_dir)
    masks = grammars.new_masks(1)
    for regex in (
        "(a|aa)*(a|aa)*(a|aa)*b",
        "((a{1,50}){1,50}){1,50}x",
        "(a{1,1000}){1,1000}",
        "(.*a){20}",
        "[a-z]{60000}",
    ):
        so = StructuredOutput("regex", regex)
        so.check("regex")
        m = grammars.matcher(so)
        grammars.fill_masks([m], masks)
        assert m.error == "" and np.any(masks[0] != 0)


def _grammars(model_dir: Path, cache_size: int = 4) -> Grammars:
    text = (model_dir / "tokenizer.json").read_text()
    return Grammars(text, 1024, (1,), cache_size=cache_size)


def test_cache_is_bounded_and_compiles_once(tiny_model_dir: Path) -> None:
    grammars = _grammars(tiny_model_dir, cache_size=2)
    a, b, c = (StructuredOutput("regex", f"x{i}") for i in range(3))
    grammars.compile(a)
    grammars.compile(a)
    assert grammars.compiles == 1
    grammars.compile(b)
    grammars.compile(c)  # evicts a (least recently used)
    assert not grammars.cached(a) and grammars.cached(b) and grammars.cached(c)
    with pytest.raises(GrammarError):
        grammars.compile(StructuredOutput("regex", "(?=a)"))


def test_matcher_rebuilt_from_tokens_agrees(tiny_model_dir: Path) -> None:
    """A worker continuing a request rebuilds its matcher from the tokens so far: same mask
    as the matcher that consumed them one by one; tokens the grammar refuses are an error
    naming the position."""
    grammars = _grammars(tiny_model_dir)
    tok = Tokenizer.from_model_dir(tiny_model_dir)
    so = _json({"type": "object", "properties": {"name": {"type": "string"}}})
    tokens = tok.encode('{"name": "ab', add_bos=False)
    live = grammars.matcher(so)
    for t in tokens:
        assert live.consume(t)
    rebuilt = grammars.matcher(so, tokens)
    masks = grammars.new_masks(2)
    grammars.fill_masks([live, rebuilt], masks)
    assert np.array_equal(masks[0], masks[1])
    bad = tok.encode("[1]", add_bos=False)
    with pytest.raises(GrammarError, match="output token 0"):
        grammars.matcher(so, bad)
