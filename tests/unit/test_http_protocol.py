"""Pure pieces of the HTTP front: chat templates (against Hugging Face's own rendering), OpenAI
field names for validation errors, request refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from model_runtime.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate, ChatTemplateError
from router.http.errors import FieldRename, OpenAIError, field_name
from router.http.protocol import ChatMessage, CompletionRequest
from router.http.translate import completion_request

MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hello there"},
    {"role": "assistant", "content": "Hi."},
    {"role": "user", "content": "Again?"},
]


def test_chat_template_renders_like_hugging_face(tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    ours = ChatTemplate.load(tiny_model_dir)
    assert ours is not None
    msgs = [ChatMessage.model_validate(m) for m in MESSAGES]
    for gen in (True, False):
        want = hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.render(msgs, add_generation_prompt=gen) == want
    enc = hf.apply_chat_template(
        MESSAGES, tokenize=True, add_generation_prompt=True, return_dict=True
    )
    text = ours.render(msgs)
    ids = list(enc["input_ids"])
    assert Tokenizer.from_model_dir(tiny_model_dir).encode(text, add_bos=False) == ids


def test_text_parts_are_joined_and_template_errors_surface(tmp_path: Path) -> None:
    source = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('user first') }}{% endif %}"
    source += "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "chat_template.jinja").write_text(source)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "ignored"}))
    t = ChatTemplate.load(tmp_path)
    assert t is not None  # the .jinja file wins over tokenizer_config.json
    parts = ChatMessage.model_validate(
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    )
    assert t.render([parts]) == "[a\nb]"
    with pytest.raises(ChatTemplateError, match="user first"):
        t.render([ChatMessage(role="system", content="x")])


def test_template_lookup_named_list_and_none(tmp_path: Path) -> None:
    cfg = {
        "chat_template": [
            {"name": "tool_use", "template": "T"},
            {"name": "default", "template": "D"},
        ]
    }
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    t = ChatTemplate.load(tmp_path)
    assert t is not None and t.source == "D"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    assert ChatTemplate.load(tmp_path) is None


@pytest.mark.parametrize(
    ("path", "rename", "want"),
    [
        ("sampling.top_p", FieldRename(), "top_p"),
        ("sampling.stop[2]", FieldRename(), "stop[2]"),
        ("sampling.stop[0]", FieldRename(scalar=frozenset({"stop"})), "stop"),
        (
            "sampling.max_tokens",
            FieldRename({"max_tokens": "max_completion_tokens"}),
            "max_completion_tokens",
        ),
        ("token_ids.ids[3]", FieldRename(), "prompt[3]"),
        ("token_ids.ids", FieldRename(), "prompt"),
        ("text", FieldRename(), "prompt"),
        ("token_ids", FieldRename({"prompt": "messages"}, frozenset({"prompt"})), "messages"),
        (
            "token_ids.ids[5]",
            FieldRename({"prompt": "messages"}, frozenset({"prompt"})),
            "messages",
        ),
    ],
)
def test_grpc_field_paths_become_openai_names(path: str, rename: FieldRename, want: str) -> None:
    assert field_name(path, rename) == want


def test_translation_defaults_and_refusals() -> None:
    req = CompletionRequest.model_validate({"model": "m", "prompt": ["only one"]})
    t = completion_request(req, "rid")
    assert t.request.text == "only one" and t.request.request_id == "rid"
    sp = t.request.sampling
    assert sp.temperature == 1.0 and not sp.HasField("max_tokens")  # OpenAI's / gRPC's defaults
    assert (
        completion_request(
            CompletionRequest.model_validate({"model": "m", "prompt": [1, 2], "top_k": -1}), "r"
        ).request.sampling.top_k
        == 0
    )  # vLLM's "off"
    assert not sp.HasField("speculative")  # the workers' setting
    off = CompletionRequest.model_validate({"model": "m", "prompt": "x", "speculative": False})
    assert completion_request(off, "r").request.sampling.speculative is False
    for body, param in (
        ({"prompt": "x", "max_tokens": 2**31}, "max_tokens"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "logit_bias": {"5": 1.0}}, "logit_bias"),
    ):
        with pytest.raises(OpenAIError) as err:
            completion_request(CompletionRequest.model_validate({"model": "m", **body}), "r")
        assert err.value.status == 400 and err.value.param == param
