"""Large HTTP request bodies are parsed, validated and translated in helper processes, never on
the router's event loop. Runs in the router process (`BodyPool`) and in its helper processes
(`translate_body`, each with the model's tokenizer and chat template loaded once).

Why a process: a JSON body costs the GIL in proportion to its *structure*, not its bytes, and
the parsers (pydantic's, the stdlib's) hold the GIL for the whole parse, so a thread does not
help: measured on one core, 1.2 µs per chat message, 52 ns per prompt token id, 0.5 µs per
value that fails validation, 15 ns per escaped character — 10 MB of one-character chat messages
is about 0.4 s of parse and seconds of template rendering, a 12 MB token-id list 0.15 s, and the
body bound (`ModelLimits.max_json_body_bytes`) grows with the context (13 MB at 32K). A helper
process does that work under its own GIL; the router's loop only reads the bytes, hands them
over (the executor's feeder thread writes the pipe with the GIL released) and takes back a
`Translated` — the `GenerateRequest` a gRPC client would send (a prompt of at most the context's
token ids) and a few flags — so its work is bounded by the context, not by the body's shape.

A body of at most `INLINE_BODY_BYTES` (64 KiB: at worst a few milliseconds of parsing) is
translated in the router process as before (the chat render on the lifecycle's threads), so an
ordinary request pays no hand-over. The pool starts on the first large body (its processes start
from a fresh `forkserver`, never forked from the threaded router) with `BODY_WORKERS` helpers; a
helper that dies is replaced with the pool (the request gets a 500 with its id).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Literal, TypeVar

from pydantic import ValidationError

from model_runtime.tokenizer import Tokenizer
from router.http.chat_template import ChatTemplate
from router.http.errors import OpenAIError, from_validation_error, internal_error
from router.http.protocol import ChatCompletionRequest, CompletionRequest
from router.http.translate import Translated, chat_request, completion_request
from router.validation import ModelLimits

log = logging.getLogger(__name__)

INLINE_BODY_BYTES = 64 * 1024
"""Bodies up to this size are parsed in the router process (module docstring)."""
BODY_WORKERS = 2
Kind = Literal["completion", "chat"]
Body = TypeVar("Body", CompletionRequest, ChatCompletionRequest)


@dataclass(frozen=True)
class BodySettings:
    """What translating a body needs besides the body: fixed for a router's life."""

    model_dir: str
    served_model_name: str
    limits: ModelLimits
    default_max_tokens: int | None  # a chat request's max_tokens when it sets none


def check_model(name: str, served: str) -> None:
    """A 404 naming `model` unless `name` is the served model's."""
    if name != served:
        raise OpenAIError(
            404,
            f"model: the model {name!r} does not exist; this server serves {served!r}",
            "model",
            "model_not_found",
        )


def parse_body(raw: bytes, model: type[Body], served: str) -> Body:
    """A `/v1/completions` or `/v1/chat/completions` body as `model`, validated (400 naming the
    field; 404 for another model than `served`)."""
    try:
        body = model.model_validate_json(raw)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
    check_model(body.model, served)
    return body


# -- the helper processes -------------------------------------------------------------------

_settings: BodySettings | None = None
_tokenizer: Tokenizer | None = None
_template: ChatTemplate | None = None


def _init(settings: BodySettings) -> None:
    """A helper's start: the model's tokenizer and chat template, once."""
    global _settings, _tokenizer, _template
    _settings = settings
    _tokenizer = Tokenizer.from_model_dir(settings.model_dir)
    _template = ChatTemplate.load(settings.model_dir)


def translate_body(kind: Kind, raw: bytes, request_id: str) -> Translated:
    """In a helper: `raw` parsed, validated and translated (chat: rendered and tokenized);
    `OpenAIError` for a body at fault."""
    s, tok = _settings, _tokenizer
    assert s is not None and tok is not None, "helper not initialized"
    if kind == "completion":
        body = parse_body(raw, CompletionRequest, s.served_model_name)
        return completion_request(body, request_id)
    chat = parse_body(raw, ChatCompletionRequest, s.served_model_name)
    return chat_request(
        chat, request_id, _template, tok, s.limits, s.model_dir, s.default_max_tokens
    )


# -- the router side ------------------------------------------------------------------------


class BodyPool:
    """The helper processes of one HTTP front (module docstring). `translate` on the loop;
    `close()` when the front stops."""

    def __init__(self, settings: BodySettings, workers: int = BODY_WORKERS) -> None:
        self.settings = settings
        self._workers = workers
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(
                max_workers=self._workers,
                mp_context=multiprocessing.get_context("forkserver"),
                initializer=_init,
                initargs=(self.settings,),
            )
        return self._pool

    async def translate(self, kind: Kind, raw: bytes, request_id: str) -> Translated:
        """`raw` translated by a helper; `OpenAIError` for a body at fault, 500 (with the
        request id, logged) when the helper died."""
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(
                self._executor(), translate_body, kind, raw, request_id
            )
        except BrokenProcessPool:
            log.exception("request %s: a body helper process died; restarting the pool", request_id)
            pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
            raise internal_error(request_id) from None

    def close(self) -> None:
        """Stop the helpers (they finish nothing: the front is stopping)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
