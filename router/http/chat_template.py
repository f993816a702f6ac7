"""A model folder's chat template, rendered with Jinja2 the way Hugging Face does. Runs in the
router process (the HTTP front's `/v1/chat/completions`).

Where the template comes from, first found wins: ``chat_template.jinja`` in the folder (newer
HF layout), then ``chat_template`` in ``tokenizer_config.json`` — a string, or a list of
``{"name", "template"}`` from which the one named ``default`` is used. No template: `load`
answers None and the chat endpoint refuses with a 400 that says so.

Rendering matches `transformers`' `apply_chat_template`: an immutable sandboxed environment
with ``trim_blocks`` and ``lstrip_blocks`` and the ``loopcontrols`` extension; the template sees
``messages`` (dicts with ``role``, ``content`` and ``name`` when given),
``add_generation_prompt``, the special tokens named in ``tokenizer_config.json``
(``bos_token``, ``eos_token``, ...), ``raise_exception(message)`` and ``strftime_now(format)``.
The rendered text already holds whatever special tokens the template writes, so it is
tokenized without adding a BOS (as HF does).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from model_runtime.tokenizer import special_token_text
from router.http.protocol import ChatMessage

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token")


class ChatTemplateError(ValueError):
    """The template failed to render these messages (its own `raise_exception`, or a bug)."""


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent)


def _call_dict(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    try:
        args: Any = json.loads(arguments)
    except json.JSONDecodeError:
        args = arguments
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": args}}


class ChatTemplate:
    """A compiled chat template plus the special tokens it may use."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self.source = source
        self.special_tokens = dict(special_tokens)

    @classmethod
    def load(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The folder's template (module docstring), or None when it has none. Raises
        ValueError naming the file for an unreadable or uncompilable one."""
        folder = Path(model_dir)
        config_path = folder / "tokenizer_config.json"
        config: dict[str, Any] = {}
        if config_path.is_file():
            try:
                loaded = json.loads(config_path.read_text())
            except json.JSONDecodeError as exc:
                raise ValueError(f"{config_path}: invalid JSON: {exc}") from exc
            config = loaded if isinstance(loaded, dict) else {}
        special = {
            k: t for k in _SPECIAL_KEYS if (t := special_token_text(config.get(k))) is not None
        }
        jinja_path = folder / "chat_template.jinja"
        if jinja_path.is_file():
            return cls(jinja_path.read_text(), special)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        if source is None:
            return None
        if not isinstance(source, str):
            raise ValueError(f"{config_path}: chat_template must be a string or a named list")
        return cls(source, special)

    def render(
        self,
        messages: Sequence[ChatMessage],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt text for `messages` (and `tools`, for a template that renders them:
        `router.http.tools`); `ChatTemplateError` when the template refuses. Assistant tool
        calls reach the template as Hugging Face passes them (arguments parsed)."""
        dicts: list[dict[str, Any]] = []
        for m in messages:
            d: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.name is not None:
                d["name"] = m.name
            if m.tool_calls:
                d["tool_calls"] = [
                    _call_dict(c.id, c.function.name, c.function.arguments) for c in m.tool_calls
                ]
            if m.tool_call_id is not None:
                d["tool_call_id"] = m.tool_call_id
            dicts.append(d)
        try:
            return self._template.render(
                messages=dicts,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc
