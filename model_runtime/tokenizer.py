"""Tokenizer wrapper over a model folder's `tokenizer.json`, plus incremental detokenization.

Torch-free: runs in the router (tokenizing prompts, turning streamed token ids into text deltas)
and in `pdserve batch`. Works with any HF fast-tokenizer file (byte-level BPE, SentencePiece-
style Metaspace) through the `tokenizers` library.

Special ids come from the folder's `config.json` / `generation_config.json` (what the model was
trained with) and fall back to the token strings named in `tokenizer_config.json`. Whether text
gets a BOS comes from `tokenizer_config.json`'s `add_bos_token` (default true), as in HF: a
model whose tokenizer adds none (SmolLM2: its BOS is ChatML's `<|im_start|>`) gets none.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

_REPLACEMENT_CHAR = "\ufffd"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _as_ids(value: object) -> list[int]:
    if value is None:
        return []
    if isinstance(value, list):
        return [int(v) for v in value]
    return [int(value)]  # type: ignore[call-overload]


def special_token_text(value: object) -> str | None:
    """`tokenizer_config.json` writes special tokens as a string or as {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


class Tokenizer:
    """Text <-> token ids for one model. Construct with `Tokenizer.from_model_dir`."""

    def __init__(
        self,
        tok: _HFTokenizer,
        bos_id: int | None,
        eos_ids: tuple[int, ...],
        adds_bos: bool = True,
    ) -> None:
        self._tok = tok
        self.bos_id = bos_id
        self.eos_ids = eos_ids
        self.adds_bos = adds_bos  # tokenizer_config.json add_bos_token

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> Tokenizer:
        """Load `<model_dir>/tokenizer.json`; raise ValueError if it is missing."""
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"model folder {model_dir}: tokenizer.json not found")
        tok = _HFTokenizer.from_file(str(path))
        config = _read_json(d / "config.json")
        gen = _read_json(d / "generation_config.json")
        tok_cfg = _read_json(d / "tokenizer_config.json")

        def by_name(key: str) -> int | None:
            name = special_token_text(tok_cfg.get(key))
            return None if name is None else tok.token_to_id(name)

        bos = config.get("bos_token_id")
        bos = gen.get("bos_token_id") if bos is None else bos
        bos_id = int(bos) if bos is not None else by_name("bos_token")
        eos: list[int] = []
        for candidate in (
            _as_ids(gen.get("eos_token_id")),
            _as_ids(config.get("eos_token_id")),
            _as_ids(by_name("eos_token")),
        ):
            eos += [i for i in candidate if i not in eos]
        return cls(tok, bos_id, tuple(eos), bool(tok_cfg.get("add_bos_token", True)))

    @property
    def vocab_size(self) -> int:
        """Number of token ids the tokenizer knows, added/special tokens included."""
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @property
    def max_token_chars(self) -> int:
        """Characters in the longest vocabulary entry (added tokens included): no token covers
        more of a text (a byte-level entry's characters are bytes, at least as many)."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        """Token ids of `text`, with the BOS id first when `add_bos`, the model has a BOS and
        its tokenizer adds one (`adds_bos`).

        The tokenizer file's own post-processor is not used, so `add_bos` means the same for
        every model whatever its template says. The work runs without the GIL (the library's
        batch path releases it, its single-text path does not), so encoding in a helper thread
        does not stall the caller's event loop.
        """
        ids: list[int] = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        if add_bos and self.adds_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`; incomplete UTF-8 sequences come out as U+FFFD."""
        return str(self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas, one `add` call per token.

    Never emits part of a character: while the decoded tail ends in U+FFFD (an incomplete UTF-8
    sequence split across tokens) the text is held back until a later token completes it, or
    until `flush()` at the end of the stream. Joining every delta and the flush gives
    `tokenizer.decode(all_ids)` for any sequence that decodes to valid text.

    Each step decodes only a short window (vLLM's prefix/read offsets): `prefix_offset..
    read_offset` is text already emitted, kept as left context because some decoders
    (SentencePiece's leading-space rule) decode a token differently at the start of a string.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.token_ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # tokens before this are emitted
        self.text = ""  # everything emitted so far

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text ("" while held back)."""
        self.token_ids.append(token_id)
        return self._advance(final=False)

    def add_many(self, token_ids: Iterable[int]) -> str:
        """Append several tokens; return the newly completed text."""
        return "".join(self.add(t) for t in token_ids)

    def flush(self) -> str:
        """End of stream: return any held-back text (with U+FFFD for incomplete bytes)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        window = self.token_ids[self._prefix_offset :]
        prefix = self.token_ids[self._prefix_offset : self._read_offset]
        prefix_text = self._tok.decode(prefix, self._skip)
        new_text = self._tok.decode(window, self._skip)
        if len(new_text) <= len(prefix_text) or (
            not final and new_text.endswith(_REPLACEMENT_CHAR)
        ):
            return ""
        delta = new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self.text += delta
        return delta


def decode_stream(
    tokenizer: Tokenizer, token_ids: Iterable[int], skip_special_tokens: bool = True
) -> Iterator[str]:
    """Yield the non-empty text deltas of `token_ids`, fed one at a time, then the flush."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    for token_id in token_ids:
        delta = detok.add(token_id)
        if delta:
            yield delta
    tail = detok.flush()
    if tail:
        yield tail
