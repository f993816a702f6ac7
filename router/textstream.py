"""Streamed token ids -> text deltas, with stop strings. Runs in the router process.

Stop-string rule (as in vLLM/OpenAI): the output text ends *before* the first occurrence of any
stop string; the stop string itself is not returned. The token ids that produced it are still
returned (they were generated), so `token_ids` may decode to more text than `text`.

To never stream text that later turns out to be part of a stop string, the last
`max(len(stop)) - 1` characters are held back until more text arrives or the stream ends::

    text so far:  "Hello, wor"      stop = ["world!"]  (6 chars -> hold back 5)
    emitted:      "Hello"           held: ", wor"

With `min_tokens`, stop strings are not looked for until that many tokens were pushed (as vLLM
does): from then on each push searches the new text and the held-back tail before it, so a stop
string wholly inside the text of the first `min_tokens - 1` tokens never matches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model_runtime.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class TextDelta:
    """What to send for one batch of tokens: new text, and whether a stop string matched."""

    text: str
    stopped: bool


class TextStream:
    """Feed token ids with `push`; call `finish` when the worker ends the stream normally."""

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str], min_tokens: int = 0) -> None:
        if any(not s for s in stop):
            raise ValueError("stop strings must not be empty")
        self._min_tokens = min_tokens
        self._num_tokens = 0
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(stop)
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._text = ""
        self._emitted = 0
        self.stopped = False

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text[: self._emitted]

    def push(self, token_ids: Sequence[int]) -> TextDelta:
        """Add tokens; return the text now safe to send. After a stop match, push is an error."""
        assert not self.stopped, "push() after a stop string matched"
        searched_to = len(self._text)
        self._text += self._detok.add_many(token_ids)
        self._num_tokens += len(token_ids)
        if self._stop and self._num_tokens >= self._min_tokens:
            start = max(0, searched_to - self._hold)
            cut = self._first_stop(start)
            if cut is not None:
                self.stopped = True
                return TextDelta(self._emit_to(cut), True)
        return TextDelta(self._emit_to(max(self._emitted, len(self._text) - self._hold)), False)

    def finish(self) -> str:
        """End of stream (no stop string): the held-back text plus any incomplete character."""
        if self.stopped:
            return ""
        searched_to = len(self._text)
        self._text += self._detok.flush()
        searching = self._stop and self._num_tokens >= self._min_tokens
        cut = self._first_stop(max(0, searched_to - self._hold)) if searching else None
        if cut is not None:
            self.stopped = True
            return self._emit_to(cut)
        return self._emit_to(len(self._text))

    def _first_stop(self, start: int) -> int | None:
        hits = [i for s in self._stop if (i := self._text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def _emit_to(self, end: int) -> str:
        delta = self._text[self._emitted : end]
        self._emitted = max(self._emitted, end)
        return delta
