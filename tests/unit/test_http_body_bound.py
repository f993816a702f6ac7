"""The HTTP front's bounds on a chat request before it is parsed or rendered: the unparsed
body scan (`router.http.body_scan`) and the content bound (`translate.check_chat_content`)."""

from __future__ import annotations

import json

import pytest

from router.http.body_scan import oversized_content
from router.http.errors import OpenAIError
from router.http.protocol import ChatCompletionRequest
from router.http.translate import check_chat_content, oversized_body
from router.validation import ModelLimits


def body(*contents: object, **extra: object) -> bytes:
    msgs = [{"role": "user", "content": c} for c in contents]
    return json.dumps({"model": "m", **extra, "messages": msgs}).encode()


def test_scan_names_the_message_that_passes_the_bound() -> None:
    raw = body("a" * 10, "b" * 10, "c" * 100, "d")
    assert oversized_content(raw, 1000) is None
    assert oversized_content(raw, 50) == 2  # 12 + 12 + 102 bytes: passed at message 2
    assert oversized_content(raw, 20) == 1
    assert oversized_content(raw, 5) == 0


def test_scan_counts_parts_lists_escapes_and_skips_other_fields() -> None:
    parts = [{"type": "text", "text": "x" * 40}, {"type": "text", "text": "y" * 40}]
    raw = body("hi", parts, stop=["z" * 500], user="u" * 500)
    assert oversized_content(raw, 100) == 1  # the parts list, not `stop` or `user`
    quoted = body('say \\"no\\" ' + "q" * 60)  # escaped quotes do not end the string
    assert oversized_content(quoted, 50) == 0
    assert oversized_content(json.dumps({"messages": [{"content": 'a\\"' * 30}]}).encode(), 40) == 0


def test_scan_gives_up_on_garbage_and_budget() -> None:
    assert oversized_content(b"[[[[", 1) is None
    assert oversized_content(b'{"messages": [{"content": "never ends', 1) is None
    # the body's first bytes only: a content still open at the cut runs at least that far
    assert oversized_content(b'{"messages": [{"content": "never ends', 5, prefix=True) == 0
    assert oversized_content(b'{"messages": [{"content": "never ends', 50, prefix=True) is None
    assert oversized_content(b'{"mess\\u0061ges": [{"content": "xxxx"}]}', 1) is None
    many = body(*(["x"] * 5000), "y" * 1000)
    assert oversized_content(many, 15_500) is None  # 20,000 steps cover ~1,600 messages
    assert oversized_content(many, 15_500, budget=100_000) == 5000


def test_oversized_body_names_the_content_or_the_prompt() -> None:
    limits = ModelLimits.for_model(vocab_size=100, context_length=16, max_token_chars=2)
    assert limits.max_prompt_chars == 60
    assert limits.max_json_body_bytes == 12 * 60 + 64 * 16 + 65536
    err = oversized_body(body("x", "y" * 100_000), limits, chat=True)
    assert (err.status, err.param) == (400, "messages[1].content")
    assert err.message.startswith("messages[1].content: too long")
    # the bulk is elsewhere: the body as a whole, named by its prompt field
    err = oversized_body(body("x", user=" " * 100_000), limits, chat=True)
    assert err.param == "messages" and "request body is" in err.message
    assert oversized_body(b"{}", limits, chat=False).param == "prompt"


def test_content_bound_counts_characters_across_messages() -> None:
    limits = ModelLimits.for_model(vocab_size=100, context_length=16, max_token_chars=2)
    ok = ChatCompletionRequest.model_validate_json(body("x" * 30, "y" * 30))
    check_chat_content(ok, limits)
    over = ChatCompletionRequest.model_validate_json(body("x" * 30, "y" * 20, "z" * 11))
    with pytest.raises(OpenAIError) as info:
        check_chat_content(over, limits)
    assert info.value.param == "messages[2].content"
    assert "61 characters" in info.value.message and "at most 60" in info.value.message
    check_chat_content(over, ModelLimits(100, 16))  # 0: no bound
