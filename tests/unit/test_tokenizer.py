"""Tokenizer wrapper and incremental detokenizer, on the tiny model's BPE (torch-free)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_runtime.tokenizer import IncrementalDetokenizer, Tokenizer, decode_stream
from tooling.models.corpus import BOS_ID, EOS_ID, PAD_ID, train_tokenizer, write_tokenizer_files

TEXTS = [
    "The lighthouse on the northern cape was built in 1871.",
    "Zoë paid €2.50 for a café crème — naïve, perhaps.",
    "ありがとう, ευχαριστώ, спасибо!",
    "日本語のテキスト and emoji 🙂🚂 mixed\nacross lines\twith tabs",
    "  leading and trailing spaces  ",
    "",
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Only the tokenizer files of the tiny preset (vocab 1024), no config.json."""
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer_files(out, train_tokenizer(1024, 20_000), model_max_length=1024)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tok_dir)


def test_special_ids_fall_back_to_tokenizer_config(tok: Tokenizer) -> None:
    assert tok.vocab_size == 1024
    assert tok.bos_id == BOS_ID
    assert tok.eos_ids == (EOS_ID,)
    assert [tok.id_to_token(i) for i in (BOS_ID, EOS_ID, PAD_ID)] == ["<s>", "</s>", "<pad>"]


def test_generation_config_eos_ids_come_first(tmp_path: Path, tok_dir: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((tok_dir / name).read_bytes())
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 2, "eos_token_id": 1}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    t = Tokenizer.from_model_dir(tmp_path)
    assert t.bos_id == 2
    assert t.eos_ids == (7, 1)


def test_add_bos_token_false_means_no_bos(tmp_path: Path, tok_dir: Path) -> None:
    """A tokenizer_config.json with add_bos_token: false (SmolLM2's) adds no BOS, as in HF."""
    (tmp_path / "tokenizer.json").write_bytes((tok_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**cfg, "add_bos_token": False}))
    t = Tokenizer.from_model_dir(tmp_path)
    assert t.bos_id == BOS_ID and not t.adds_bos
    assert t.encode("the lighthouse") == t.encode("the lighthouse", add_bos=False)
    assert t.encode("the lighthouse")[0] != BOS_ID


def test_missing_tokenizer_json_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json not found"):
        Tokenizer.from_model_dir(tmp_path)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids[0] == BOS_ID
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.encode(text, add_bos=False) == ids[1:]
    assert tok.decode(ids) == text  # BOS is skipped
    assert tok.decode(ids, skip_special_tokens=False) == "<s>" + text


def test_common_words_are_single_tokens(tok: Tokenizer) -> None:
    # The BPE learned English from the corpus: frequent words are one token each.
    for word in (" the", " and", " water", " sea", " river"):
        assert len(tok.encode(word, add_bos=False)) == 1, word


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_full_decode(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    tail = detok.flush()
    assert "".join(deltas) + tail == text == detok.text
    assert tail == ""  # valid text never leaves anything held back
    assert all("\ufffd" not in d for d in deltas), deltas
    assert "".join(decode_stream(tok, ids)) == text


def test_multibyte_char_split_across_tokens_is_held_back(tok: Tokenizer) -> None:
    # "語" is not in the corpus, so byte-level BPE spells it as several byte tokens.
    ids = tok.encode("語", add_bos=False)
    assert len(ids) > 1, ids
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    assert deltas[:-1] == [""] * (len(ids) - 1)
    assert deltas[-1] == "語"


def test_every_prefix_emits_only_whole_characters(tok: Tokenizer) -> None:
    text = "🙂 語 café 🚂"
    ids = tok.encode(text, add_bos=False)
    detok = IncrementalDetokenizer(tok)
    for n, token_id in enumerate(ids, start=1):
        detok.add(token_id)
        assert text.startswith(detok.text), (n, detok.text)
        # Whatever is emitted is exactly the longest complete-character prefix decoded so far.
        assert detok.text == tok.decode(ids[:n]).rstrip("\ufffd")


def test_truncated_char_is_flushed_as_replacement(tok: Tokenizer) -> None:
    ids = tok.encode("ab語", add_bos=False)
    detok = IncrementalDetokenizer(tok)
    emitted = detok.add_many(ids[:-1])  # drop the last byte of "語"
    assert emitted == "ab"
    assert detok.flush() == "\ufffd"
    assert "".join(decode_stream(tok, ids[:-1])) == "ab\ufffd"


def test_special_tokens_skipped_or_kept(tok: Tokenizer) -> None:
    ids = [BOS_ID, *tok.encode("hello", add_bos=False), EOS_ID]
    assert "".join(decode_stream(tok, ids)) == "hello"
    kept = "".join(decode_stream(tok, ids, skip_special_tokens=False))
    assert kept == "<s>hello</s>"
