"""Find where a chat request body too large to parse holds its bulk. Runs in the router process
(the HTTP front, on the event loop, before any JSON parsing).

A body beyond `ModelLimits.max_json_body_bytes` is refused unparsed: parsing it would hold the
GIL for tens of milliseconds per 10 MB. The refusal should still name the field at fault, which
for a chat request is almost always one message's ``content``. `oversized_content` walks the
JSON's structure without decoding it — strings are skipped with `bytes.find`, so a 30 MB string
costs one memchr — and answers the index of the message whose content pushes the running total
of content bytes past a bound.

The walk is a bounded effort, not a validator: it gives up (answers None) after `budget`
structural steps, on malformed JSON, or when the keys are escaped; the caller then names the
body as a whole.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_LITERAL_END = re.compile(rb"[,\]}\s]")
_WHITESPACE = frozenset(b" \t\r\n")
_BACKSLASH = 0x5C


@dataclass
class _Frame:
    """One open container: an object (`key` is the key being read or last read) or an array
    (`index` of the element being read)."""

    is_object: bool
    start: int
    key: bytes | None = None
    expect_key: bool = True
    index: int = 0


def _string_end(raw: bytes, pos: int, budget: list[int]) -> int | None:
    """Index just past the string that opens at `raw[pos]` (a quote); None when it does not
    end or the budget ran out."""
    j = pos + 1
    while True:
        j = raw.find(b'"', j)
        if j < 0:
            return None
        k = j - 1
        while raw[k] == _BACKSLASH:
            k -= 1
            budget[0] -= 1
            if budget[0] <= 0:
                return None
        if (j - 1 - k) % 2 == 0:  # an even run of backslashes: this quote ends the string
            return j + 1
        j += 1
        budget[0] -= 1
        if budget[0] <= 0:
            return None


def oversized_content(
    raw: bytes, max_bytes: int, budget: int = 20_000, prefix: bool = False
) -> int | None:
    """The index ``i`` of the first message at which the JSON bytes of ``messages[0..i]``'s
    ``content`` values (quotes and escapes included) exceed `max_bytes`; None when no such
    message was found within `budget` steps (module docstring). `prefix`: `raw` is the body's
    first bytes only, so a string still open at its end runs at least that far."""
    frames: list[_Frame] = []
    left = [budget]
    total = 0
    pos, n = 0, len(raw)
    while pos < n:
        left[0] -= 1
        if left[0] <= 0:
            return None
        c = raw[pos]
        if c in _WHITESPACE or c == 0x3A:  # ':'
            pos += 1
            continue
        top = frames[-1] if frames else None
        if c == 0x2C:  # ','
            if top is None:
                return None
            if top.is_object:
                top.expect_key = True
            else:
                top.index += 1
            pos += 1
            continue
        if c in b"{[":
            frames.append(_Frame(is_object=c == 0x7B, start=pos))
            pos += 1
            continue
        start = pos
        if c in b"}]":
            if top is None:
                return None
            frames.pop()
            start, end = top.start, pos + 1
        elif c == 0x22:  # '"'
            string_end = _string_end(raw, pos, left)
            if string_end is None:
                if not prefix or left[0] <= 0:
                    return None
                string_end = n  # open past the prefix: it runs at least to its end
            end = string_end
            if top is not None and top.is_object and top.expect_key:
                top.key, top.expect_key = raw[pos + 1 : end - 1], False
                pos = end
                continue
        else:
            m = _LITERAL_END.search(raw, pos)
            end = n if m is None else m.start()
        pos = end
        # A value [start, end) is complete; is it messages[i].content?
        if (
            len(frames) == 3
            and frames[0].key == b"messages"
            and not frames[1].is_object
            and frames[2].is_object
            and frames[2].key == b"content"
        ):
            total += end - start
            if total > max_bytes:
                return frames[1].index
    return None
