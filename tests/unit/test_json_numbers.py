"""The length bound on generated JSON numbers (`model_runtime.json_numbers`) and its place in
a request's matcher (`model_runtime.grammar.Matcher`): the integer part and the fraction stop
at `MAX_DIGITS` digits, the exponent at `MAX_EXPONENT_DIGITS`; digits in strings, grammars
that demand more digits and non-JSON constraints are not bounded; every path (one mask, batch
masks, consume, allows, rollback, rebuild from tokens) sees the same bound."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from model_runtime.grammar import Grammars, Matcher
from model_runtime.json_numbers import (
    MAX_DIGITS,
    MAX_EXPONENT_DIGITS,
    START,
    NumberBound,
    advance,
    room,
)
from model_runtime.structured import StructuredOutput
from model_runtime.tokenizer import Tokenizer


@pytest.mark.parametrize(
    ("text", "left"),
    [
        (b"", MAX_DIGITS),
        (b"123", MAX_DIGITS - 3),
        (b"-12.", MAX_DIGITS),
        (b"0.1234", MAX_DIGITS - 4),
        (b"1e+", MAX_EXPONENT_DIGITS),
        (b"1E-12", MAX_EXPONENT_DIGITS - 2),
        (b"2e1", MAX_EXPONENT_DIGITS - 1),
        (b'{"a": true, "b": 12', MAX_DIGITS - 2),
        (b'"' + b"1" * 50, None),  # digits in a string are text
        (b'"' + b"1" * 50 + b'", 7', MAX_DIGITS - 1),
        (b'"a\\"12345', None),  # an escaped quote does not end the string
        (b'"a\\\\"12', MAX_DIGITS - 2),  # an escaped backslash does not escape the quote
    ],
)
def test_state_reads_the_number_being_written(text: bytes, left: int | None) -> None:
    assert room(advance(START, text)) == left
    # the state does not depend on how the text is split into tokens
    state = START
    for i in range(len(text)):
        state = advance(state, text[i : i + 1])
    assert room(state) == left


def _bits(row: np.ndarray, n: int) -> list[int]:
    return [t for t in range(n) if row[t // 32] >> (t % 32) & 1]


def test_restrict_clears_tokens_by_their_leading_digits() -> None:
    bound = NumberBound([b"1", b"12", b"123", b"a", b".", b"1a"], mask_words=1)
    assert bound.max_lead == 3
    near = advance(START, b"1" * (MAX_DIGITS - 1))  # room for one more digit
    row = np.full(1, -1, dtype=np.int32)
    bound.restrict(near, row)
    assert _bits(row, 6) == [0, 3, 4, 5]
    full = advance(START, b"1" * MAX_DIGITS)
    row = np.full(1, -1, dtype=np.int32)
    bound.restrict(full, row)
    assert _bits(row, 6) == [3, 4]
    # the grammar allows only digits: the bound gives way
    row = np.array([0b000111], dtype=np.int32)
    assert not bound.binds(full, row)
    bound.restrict(full, row)
    assert _bits(row, 6) == [0, 1, 2]


@pytest.fixture(scope="module")
def setup(tiny_model_dir: Path) -> tuple[Grammars, Tokenizer]:
    text = (tiny_model_dir / "tokenizer.json").read_text()
    return Grammars(text, 1024, (1,)), Tokenizer.from_model_dir(tiny_model_dir)


def _ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_bos=False)


def _digit(tok: Tokenizer) -> int:
    (one,) = _ids(tok, "1")
    return one


def _walk(m: Matcher, tokens: list[int]) -> None:
    for t in tokens:
        assert m.consume(t), (t, m.error)


def _allowed(g: Grammars, m: Matcher, token: int) -> bool:
    masks = g.new_masks(1)
    g.fill_masks([m], masks)
    return bool(masks[0, token // 32] >> (token % 32) & 1)


def test_each_part_of_a_number_is_bounded(setup: tuple[Grammars, Tokenizer]) -> None:
    g, tok = setup
    one = _digit(tok)
    m = g.matcher(StructuredOutput("json", json.dumps({"type": "number"})))
    for part, cap in (("", MAX_DIGITS), (".", MAX_DIGITS), ("e", MAX_EXPONENT_DIGITS)):
        _walk(m, _ids(tok, part))
        _walk(m, [one] * (cap - 1))
        assert _allowed(g, m, one) and m.allows(one)
        _walk(m, [one])
        assert not _allowed(g, m, one) and not m.allows(one)
    assert not m.consume(one)
    assert "length bound" in m.error


def test_what_is_not_bounded(setup: tuple[Grammars, Tokenizer]) -> None:
    """Digits in a string, a grammar that demands more digits (the bound gives way), and a
    constraint whose output is not JSON."""
    g, tok = setup
    one = _digit(tok)
    many = MAX_DIGITS + 10
    for so, prefix in (
        (StructuredOutput("json", json.dumps({"type": "string"})), '"'),
        # JSON output (it embeds %json) whose grammar demands 40 digits in a row
        (StructuredOutput("grammar", 'start: /[0-9]{40}/ j\nj: %json {"type": "string"}'), ""),
        (StructuredOutput("regex", "[0-9]+"), ""),
    ):
        m = g.matcher(so)
        _walk(m, _ids(tok, prefix) + [one] * many)
        assert _allowed(g, m, one) and m.allows(one), so


def test_every_path_sees_the_same_bound(setup: tuple[Grammars, Tokenizer]) -> None:
    """Batch masks equal one-row masks; a matcher rebuilt from the tokens, and one rolled
    back to them, mask as the one that consumed them."""
    g, tok = setup
    one = _digit(tok)
    so = StructuredOutput("json", json.dumps({"type": "object", "properties": {"n": {}}}))
    head = _ids(tok, '{"n": ')
    at_bound = head + [one] * MAX_DIGITS
    live = g.matcher(so, at_bound)
    rebuilt = g.matcher(so, at_bound)
    early = g.matcher(so, head + [one] * (MAX_DIGITS - 1))
    batch = g.new_masks(3)
    g.fill_masks([live, rebuilt, early], batch)
    single = g.new_masks(1)
    live.fill_mask(single, 0)
    assert np.array_equal(batch[0], single[0]) and np.array_equal(batch[0], batch[1])
    assert not _allowed(g, live, one) and _allowed(g, early, one)
    live.rollback(1)
    g.fill_masks([live], single)
    assert np.array_equal(single[0], batch[2])
    assert _allowed(g, live, one)
