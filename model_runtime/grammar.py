"""Grammar-constrained decoding on a worker: compiled grammars, per-request matchers, batched
next-token masks. Runs in worker processes (engine thread; compiles also on the worker's
compile threads). Torch-free; the sampler applies the masks (`model_runtime.sampler`).

The engine is llguidance (chosen by measurement: `docs/structured-output.md`).

- `Grammars` is built once per model from its ``tokenizer.json`` (the tokenizer info, ~0.2 s)
  and shared by everything on the worker that compiles or matches. It keeps compiled grammars
  in a bounded LRU keyed by `StructuredOutput` (`compile`): a compiled grammar is a pristine
  matcher, and each request gets a `deep_copy` of it (cheap: the lexer and grammar are shared).
  `compile` is thread-safe; the worker's RPC layer calls it on compile threads before the
  request reaches the engine thread, so the engine thread finds it cached.
- `Matcher` is one request's state: the grammar plus every token consumed so far. It is never
  serialized: a worker that continues a request (decode after prefill, a migration's new
  leg) rebuilds it by consuming the request's tokens so far (`Grammars.matcher(..., tokens)`),
  which also checks that they agree with the grammar.
- `fill_masks` computes the masks of a batch's constrained rows in one call (llguidance's
  executor, in parallel, outside the GIL) into an int32 bitmask ``[rows, ceil(V / 32)]``:
  bit ``t % 32`` of word ``t // 32`` is set when token ``t`` is allowed.

Every compile and mask runs under `structured.limits()`; a grammar that exceeds them puts its
matcher in an error state (`Matcher.error`), which ends that request, never the worker.

A matcher whose output is JSON (`StructuredOutput.json_output`) also keeps the length bound on
numbers (`model_runtime.json_numbers`): its masks lose the tokens that would run a number past
the bound (in the rare step that is near it), and `consume` / `allows` refuse them, so the
grammar a request follows is the llguidance grammar and the bound together, on every path
(batch masks, speculative verification, the hand-off's check, a rebuild from tokens).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import llguidance
import numpy as np

from model_runtime import json_numbers
from model_runtime.json_numbers import NumberBound
from model_runtime.structured import StructuredOutput, limits

DEFAULT_CACHE_SIZE = 256


class GrammarError(ValueError):
    """A grammar that does not compile, or tokens it does not accept."""


class Matcher:
    """One request's grammar state (module docstring): the llguidance matcher, and with
    `bound` the JSON number bound's state after each consumed token (for `rollback`)."""

    def __init__(self, inner: llguidance.LLMatcher, bound: NumberBound | None = None) -> None:
        self._m = inner
        self._bound = bound
        self._states = [json_numbers.START]
        self._refused = ""  # why the number bound refused a token ("" while it has not)

    def consume(self, token: int) -> bool:
        """Advance past `token`; False (the matcher broken: `error` says why) if the grammar
        or the number bound does not allow it."""
        if self._bound_refuses(token):
            self._refused = f"token {token} runs a JSON number past its length bound"
            return False
        if not self._m.consume_token(token):
            return False
        if self._bound is not None:
            self._states.append(json_numbers.advance(self._states[-1], self._bound.text[token]))
        return True

    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` `consume`s (speculative decoding walks a request's
        proposals through its matcher to mask each verification row, then rolls back: the
        tokens it keeps are consumed again as they are appended)."""
        if num_tokens:
            self._m.rollback(num_tokens)
            if self._bound is not None:
                del self._states[-num_tokens:]

    def allows(self, token: int) -> bool:
        """Whether `token` may come next (nothing is consumed)."""
        if self._bound_refuses(token):
            return False
        return bool(self._m.validate_tokens([token]) == 1)

    @property
    def done(self) -> bool:
        """The grammar is complete and allows nothing more (the request ends 'stop')."""
        return bool(self._m.is_stopped())

    @property
    def error(self) -> str:
        """Why the matcher broke (a resource limit, a token it refused); "" while healthy."""
        if self._refused:
            return self._refused
        return str(self._m.get_error()) if self._m.is_error() else ""

    def fill_mask(self, mask: np.ndarray, row: int) -> None:
        v = mask[row]
        self._m.unsafe_compute_mask_ptr(v.ctypes.data, v.nbytes)
        self.bound_mask(v)

    def bound_mask(self, row: np.ndarray) -> None:
        """Apply the number bound to `row`, the grammar's mask for the next token."""
        if self._bound is not None and self._bound.near(self._states[-1]):
            self._bound.restrict(self._states[-1], row)

    def _bound_refuses(self, token: int) -> bool:
        """Whether the number bound refuses `token` now: it would exceed the bound, and some
        token the grammar allows keeps within it (otherwise the bound gives way)."""
        if self._bound is None or not self._bound.exceeds(self._states[-1], token):
            return False
        row = np.empty(self._bound.over.shape[1], dtype=np.int32)
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        return self._bound.binds(self._states[-1], row)


class Grammars:
    """The model's tokenizer info and its compiled grammars (module docstring)."""

    def __init__(
        self,
        tokenizer_json: str,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        """`vocab_size` is the model's (its logits' width, possibly more than the
        tokenizer's entries); `eos_token_ids` end a request whose grammar is complete."""
        if cache_size < 1:
            raise ValueError(f"cache_size must be >= 1, got {cache_size}")
        self.tokenizer = llguidance.LLTokenizer(
            tokenizer_json, n_vocab=vocab_size, eos_token=list(eos_token_ids)
        )
        self.vocab_size = vocab_size
        self.mask_words = (vocab_size + 31) // 32
        self.cache_size = cache_size
        self._cache: OrderedDict[StructuredOutput, llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()
        self._executor = llguidance.LLExecutor(num_threads=2)
        self.number_bound = NumberBound(_token_texts(self.tokenizer, vocab_size), self.mask_words)
        self.compiles = 0  # compiles run (cache misses), for tests and metrics

    @classmethod
    def from_model_dir(
        cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> Grammars:
        text = (Path(model_dir) / "tokenizer.json").read_text()
        return cls(text, vocab_size, eos_token_ids)

    def compile(self, so: StructuredOutput) -> llguidance.LLMatcher:
        """The pristine matcher of `so`, compiled once (LRU of `cache_size`). Raises
        GrammarError when it does not compile or breaks `structured.limits()`."""
        with self._lock:
            hit = self._cache.get(so)
            if hit is not None:
                self._cache.move_to_end(so)
                return hit
        try:
            grammar = so.grammar()
        except ValueError as exc:
            raise GrammarError(str(exc)) from None
        # The constructor releases the GIL while it builds the grammar.
        m = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0, limits=limits())
        if m.is_error():
            raise GrammarError(" ".join(m.get_error().replace("^", " ").split()))
        with self._lock:
            self.compiles += 1
            self._cache[so] = m
            self._cache.move_to_end(so)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
        return m

    def cached(self, so: StructuredOutput) -> bool:
        with self._lock:
            return so in self._cache

    def matcher(self, so: StructuredOutput, tokens: Sequence[int] = ()) -> Matcher:
        """A fresh matcher for `so` that has consumed `tokens` (a request's output so far).
        GrammarError naming the first token the grammar refuses: the tokens and the grammar
        disagree (a worker continuing a request checks the hand-off this way)."""
        bound = self.number_bound if so.json_output else None
        m = Matcher(self.compile(so).deep_copy(), bound)
        for i, tok in enumerate(tokens):
            if not m.consume(tok):
                raise GrammarError(
                    f"output token {i} ({tok}) is not allowed by the request's grammar: "
                    f"{m.error or 'refused'}"
                )
        return m

    def new_masks(self, rows: int) -> np.ndarray:
        """A mask buffer for `rows` rows (all tokens allowed)."""
        return np.full((rows, self.mask_words), -1, dtype=np.int32)

    def fill_masks(self, matchers: Sequence[Matcher], masks: np.ndarray) -> None:
        """Row i of `masks` := the next-token mask of `matchers[i]`, all in one call."""
        assert masks.shape[0] >= len(matchers) and masks.shape[1] == self.mask_words, (
            masks.shape,
            len(matchers),
        )
        assert masks.dtype == np.int32 and masks.flags["C_CONTIGUOUS"]
        if len(matchers) == 1:
            matchers[0].fill_mask(masks, 0)
            return
        self._executor.unsafe_compute_mask_ptr(
            [(m._m, i) for i, m in enumerate(matchers)],
            masks.ctypes.data,
            self.mask_words * 4,
            masks.shape[0],
        )
        for i, m in enumerate(matchers):
            m.bound_mask(masks[i])


def _token_texts(tokenizer: llguidance.LLTokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's text; b"" for special tokens and ids past the tokenizer's entries."""
    n = tokenizer.vocab_size
    return [
        b"" if t >= n or tokenizer.is_special_token(t) else tokenizer.decode_bytes([t])
        for t in range(vocab_size)
    ]
