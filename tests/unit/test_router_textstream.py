"""Unit tests of `router.textstream.TextStream` with the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_runtime.tokenizer import Tokenizer
from router.textstream import TextStream


@pytest.fixture(scope="module")
def tok(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def run(tok: Tokenizer, ids: list[int], stop: list[str]) -> tuple[list[str], bool, int]:
    """Push one id at a time; return (deltas, stopped, tokens consumed)."""
    stream = TextStream(tok, stop)
    deltas = []
    for n, t in enumerate(ids, 1):
        d = stream.push([t])
        deltas.append(d.text)
        if d.stopped:
            return deltas, True, n
    deltas.append(stream.finish())
    return deltas, stream.stopped, len(ids)


def test_deltas_join_to_the_full_decode(tok: Tokenizer) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. Ünïcödé ☃ 漢字!", add_bos=False)
    deltas, stopped, _ = run(tok, ids, [])
    assert not stopped
    assert "".join(deltas) == tok.decode(ids)
    assert all("\ufffd" not in d for d in deltas)  # never a partial character


def test_stop_string_cuts_before_the_match_and_holds_back(tok: Tokenizer) -> None:
    text = "alpha beta gamma delta"
    ids = tok.encode(text, add_bos=False)
    deltas, stopped, used = run(tok, ids, ["gamma", "zzz"])
    assert stopped and "".join(deltas) == "alpha beta "
    assert used < len(ids)  # tokens after the match were not consumed
    # nothing of "gamma" was ever streamed, even as a prefix
    assert not any("g" in d for d in deltas)


def test_earliest_of_several_stop_strings_wins(tok: Tokenizer) -> None:
    ids = tok.encode("one two three four", add_bos=False)
    deltas, stopped, _ = run(tok, ids, ["four", "two"])
    assert stopped and "".join(deltas) == "one "


def test_stop_string_spanning_tokens_and_at_the_very_end(tok: Tokenizer) -> None:
    ids = tok.encode("hello world", add_bos=False)
    deltas, stopped, used = run(tok, ids, ["lo wor"])
    assert stopped and "".join(deltas) == "hel"
    deltas, stopped, used = run(tok, ids, ["world"])
    assert stopped and "".join(deltas) == "hello " and used == len(ids)


def test_no_match_flushes_the_held_back_text(tok: Tokenizer) -> None:
    text = "abc def ghi jkl mno"
    ids = tok.encode(text, add_bos=False)
    stream = TextStream(tok, ["xyzxyzxyz"])
    streamed = "".join(stream.push([t]).text for t in ids)
    assert streamed == text[: len(text) - 8]  # the last 8 characters were held back
    tail = stream.finish()
    assert streamed + tail == text and not stream.stopped


def test_empty_stop_string_is_refused(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        TextStream(tok, ["ok", ""])


def test_stop_strings_wait_for_min_tokens(tok: Tokenizer) -> None:
    ids = tok.encode("ab cd ab cd ab", add_bos=False)

    def stopped_at(stream: TextStream) -> int:
        for i, t in enumerate(ids):
            if stream.push([t]).stopped:
                return i
        return len(ids)

    first = stopped_at(TextStream(tok, ["ab"]))
    assert first < len(ids) - 1  # the first "ab" ends a stream without min_tokens
    late = stopped_at(TextStream(tok, ["ab"], min_tokens=len(ids)))
    assert late == len(ids) - 1  # only the token that reaches min_tokens may stop it
