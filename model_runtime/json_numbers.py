"""The length bound on the numbers of generated JSON. Runs in worker processes (the engine
thread, beside each constrained request's grammar matcher: `model_runtime.grammar`).
Torch-free.

A JSON number's grammar (`-?(0|[1-9][0-9]*)(\\.[0-9]+)?([eE][+-]?[0-9]+)?`) never ends by
itself: a small model can write the digits of a fraction forever (SmolLM2-135M at
temperature 0.8 wrote 390 of them for a probability). Digits past a double's precision carry
no meaning, so the numbers of generated JSON are bounded, as llama.cpp's schema converter
bounds them (16 + 16 digits) and other engines cap digit runs; llguidance, the grammar engine,
has no such option, so the bound is kept here, beside the grammar:

- the integer part and the fraction: at most `MAX_DIGITS` (20) digits each: every 64-bit
  integer fits, and a double's 17 significant digits with 3 leading zeros to spare;
- the exponent: at most `MAX_EXPONENT_DIGITS` (3) digits, a double's range (1e308, 5e-324).

Digits inside strings are text, never bounded. A token is judged by the digits it adds to the
run in progress (its leading digits); the digits of a run that starts inside a token (``.5``)
count from there on (SmolLM2's digits are single tokens). When the grammar itself demands
more digits (a Lark grammar that embeds JSON may ask for 40 digits in a row), the bound gives
way: it never leaves a step without a token the grammar allows. (llguidance's own numeric
ranges never do: their bounds are 64-bit.)

The state is read from the output text alone (`advance`: in a string or not, after an escape
or not, which part of a number, digits so far in it), so a worker that rebuilds a request's
matcher from its tokens rebuilds the bound's state too. `NumberBound` holds the per-tokenizer
tables: each token's bytes and leading digits, and the masks of tokens that would overrun a
run of k more digits.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

MAX_DIGITS = 20
"""Most digits in a JSON number's integer part, and in its fraction."""
MAX_EXPONENT_DIGITS = 3
"""Most digits in a JSON number's exponent."""

# The state, one int: digits in the current run << 4 | part << 2 | escaped << 1 | in_string.
_IN_STRING, _ESCAPED = 1, 2
_INT, _FRAC, _EXP = 0, 1, 2  # which part of a number a digit run is in (bits 2-3)
_RUN_SHIFT = 4
START = 0
"""The state before any output: outside a string, no digits."""

_QUOTE, _BACKSLASH, _DOT = ord('"'), ord("\\"), ord(".")
_EXP_MARKS, _SIGNS = frozenset(b"eE"), frozenset(b"+-")
_DIGITS = frozenset(b"0123456789")


def advance(state: int, data: bytes) -> int:
    """The state after the output text `data` follows a text that left `state`."""
    for b in data:
        if state & _IN_STRING:
            if state & _ESCAPED:
                state &= ~_ESCAPED
            elif b == _BACKSLASH:
                state |= _ESCAPED
            elif b == _QUOTE:
                state = START
        elif b in _DIGITS:
            state += 1 << _RUN_SHIFT
        elif b == _QUOTE:
            state = _IN_STRING
        elif b == _DOT:
            state = _FRAC << 2
        elif b in _EXP_MARKS:
            state = _EXP << 2
        elif b in _SIGNS and (state >> 2) & 3 == _EXP and state >> _RUN_SHIFT == 0:
            pass  # the exponent's sign: its digits follow
        else:
            state = START
    return state


def room(state: int) -> int | None:
    """How many more digits the number being written may take; None inside a string."""
    if state & _IN_STRING:
        return None
    cap = MAX_EXPONENT_DIGITS if (state >> 2) & 3 == _EXP else MAX_DIGITS
    return cap - (state >> _RUN_SHIFT)


class NumberBound:
    """A tokenizer's tables for the bound (module docstring). Immutable once built; shared by
    every matcher on the worker."""

    def __init__(self, text: Sequence[bytes], mask_words: int) -> None:
        """`text[t]`: token t's text (b"" for special tokens and ids past the tokenizer's
        entries); `mask_words`: int32 words of a mask row (bit t % 32 of word t // 32)."""
        self.text = list(text)
        self.lead = np.array([_leading_digits(b) for b in self.text], dtype=np.int32)
        """Leading digits of each token: how many it adds to a run in progress."""
        self.max_lead = int(self.lead.max(initial=0))
        bits = np.zeros((max(self.max_lead, 1), mask_words * 32), dtype=bool)
        for k in range(self.max_lead):
            bits[k, : len(self.lead)] = self.lead > k
        self.over = np.packbits(bits, axis=1, bitorder="little").view("<i4")
        """over[k]: the tokens that start with more than k digits, as a mask row."""

    def exceeds(self, state: int, token: int) -> bool:
        """Whether `token` would take the number being written past the bound."""
        left = room(state)
        return left is not None and int(self.lead[token]) > left

    def near(self, state: int) -> bool:
        """Whether some token could exceed the bound now (rarely: the last few digits)."""
        left = room(state)
        return left is not None and left < self.max_lead

    def binds(self, state: int, row: np.ndarray) -> bool:
        """Whether the bound takes effect on the grammar's mask `row`: some token it allows
        keeps within the bound (else the bound gives way)."""
        left = room(state)
        if left is None or left >= self.max_lead:
            return True
        return bool((row & ~self.over[max(left, 0)]).any())

    def restrict(self, state: int, row: np.ndarray) -> None:
        """Clear from the grammar's mask `row` the tokens that exceed the bound, unless that
        clears every token the grammar allows (module docstring)."""
        left = room(state)
        if left is None or left >= self.max_lead:
            return
        bounded = row & ~self.over[max(left, 0)]
        if bounded.any():
            row[:] = bounded


def _leading_digits(text: bytes) -> int:
    n = 0
    while n < len(text) and text[n] in _DIGITS:
        n += 1
    return n
