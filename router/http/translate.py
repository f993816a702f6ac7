"""OpenAI request -> `pdserve.v1.GenerateRequest`. Runs in the router process (HTTP front).

The HTTP front builds the same `GenerateRequest` a gRPC client would send and hands it to the
request lifecycle, so the limits, defaults and error texts are the gRPC API's own. This module
only does what OpenAI's shape needs first:

- refuse what pdserve does not do (`n` > 1, penalties, `echo`, batched prompts, ...) with a
  400 naming the field;
- apply OpenAI's defaults where they differ from gRPC's: `temperature` 1.0 when unset; a chat
  request without `max_tokens` / `max_completion_tokens` may use the rest of the context (a
  decode worker books KV blocks for all of it, so set a limit where throughput matters);
- render chat messages with the model's template and tokenize them (no BOS added: the
  template writes its own special tokens);
- keep values protobuf cannot hold (negative seeds, > int32) from reaching it: they get the
  validation's own message.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2
from router.http.chat_template import ChatTemplate, ChatTemplateError
from router.http.errors import FieldRename, OpenAIError
from router.http.protocol import (
    NEUTRAL_ONLY,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from router.validation import MAX_SEED

OPENAI_DEFAULT_TEMPERATURE = 1.0
_INT32 = 2**31


@dataclass(frozen=True)
class Translated:
    """What the handlers need: the request for the lifecycle and how to answer."""

    request: inference_pb2.GenerateRequest
    rename: FieldRename  # gRPC field paths -> this request's OpenAI names
    stream: bool
    include_usage: bool
    logprobs: int | None  # top alternatives per token; None: no logprobs


def _check_neutral(req: SamplingRequest) -> None:
    values = req.model_dump(include=set(NEUTRAL_ONLY) & set(type(req).model_fields))
    for name, value in values.items():
        neutral = NEUTRAL_ONLY[name]
        if value == neutral or (name == "logit_bias" and value == {}):
            continue
        if name == "best_of" and value == 1:
            continue
        if name == "n":
            raise OpenAIError.invalid("n", f"only n=1 is supported, got {value}")
        raise OpenAIError.invalid(name, f"not supported (only {neutral!r}), got {value!r}")


def _int32(name: str, value: int) -> int:
    if not -_INT32 <= value < _INT32:
        raise OpenAIError.invalid(name, f"out of range, got {value}")
    return value


def _sampling(
    req: SamplingRequest, max_tokens: int | None, max_name: str
) -> tuple[inference_pb2.SamplingParams, FieldRename]:
    _check_neutral(req)
    if req.stream_options is not None and not req.stream:
        raise OpenAIError.invalid("stream_options", "only allowed with stream: true")
    sp = inference_pb2.SamplingParams(
        temperature=OPENAI_DEFAULT_TEMPERATURE if req.temperature is None else req.temperature,
        ignore_eos=req.ignore_eos,
    )
    if max_tokens is not None:
        sp.max_tokens = _int32(max_name, max_tokens)
    if req.top_p is not None:
        sp.top_p = req.top_p
    if req.top_k is not None:
        sp.top_k = 0 if req.top_k == -1 else _int32("top_k", req.top_k)  # vLLM: -1 = off
    if req.seed is not None:
        if not 0 <= req.seed <= MAX_SEED:
            raise OpenAIError.invalid("seed", f"must be in [0, 2^63 - 1], got {req.seed}")
        sp.seed = req.seed
    if req.min_tokens is not None:
        sp.min_tokens = _int32("min_tokens", req.min_tokens)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp.stop.extend(stops)
    scalar = frozenset({"stop"}) if isinstance(req.stop, str) else frozenset()
    return sp, FieldRename({"max_tokens": max_name}, scalar)


def completion_request(req: CompletionRequest, request_id: str) -> Translated:
    """`/v1/completions` -> `GenerateRequest` (see the module docstring)."""
    sp, rename = _sampling(req, req.max_tokens, "max_tokens")
    if req.logprobs is not None:
        sp.logprobs = _int32("logprobs", req.logprobs)
    out = inference_pb2.GenerateRequest(request_id=request_id, sampling=sp)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        if len(prompt) != 1:
            raise OpenAIError.invalid(
                "prompt",
                f"batched prompts are not supported: send one per request, got {len(prompt)}",
            )
        prompt = prompt[0]
        rename = FieldRename(rename.heads, rename.scalar | {"prompt"})
    if isinstance(prompt, str):
        out.text = prompt
    else:
        ids = [_int32(f"prompt[{i}]", t) for i, t in enumerate(prompt)]  # type: ignore[arg-type]
        out.token_ids.ids.extend(ids)
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Translated(out, rename, req.stream, include_usage, req.logprobs)


def chat_request(
    req: ChatCompletionRequest,
    request_id: str,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    context_length: int,
    model_dir: str,
) -> Translated:
    """`/v1/chat/completions` -> `GenerateRequest`: messages rendered and tokenized here."""
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise OpenAIError.invalid(
            "max_completion_tokens", "set max_tokens or max_completion_tokens, not both"
        )
    max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else None
    max_tokens = req.max_tokens if max_tokens is None else max_tokens
    if template is None:
        raise OpenAIError.invalid(
            "messages",
            f"the model folder {model_dir} has no chat template (no chat_template in its "
            "tokenizer_config.json, no chat_template.jinja): use /v1/completions",
        )
    sp, rename = _sampling(req, max_tokens, max_name)
    logprobs: int | None = None
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError.invalid("top_logprobs", "only allowed with logprobs: true")
    if req.logprobs:
        logprobs = _int32("top_logprobs", req.top_logprobs or 0)
        sp.logprobs = logprobs
    try:
        text = template.render(req.messages)
    except ChatTemplateError as exc:
        raise OpenAIError.invalid("messages", str(exc)) from exc
    ids = tokenizer.encode(text, add_bos=False)
    if max_tokens is None:  # OpenAI: up to the rest of the context
        sp.max_tokens = max(1, context_length - len(ids))
    out = inference_pb2.GenerateRequest(request_id=request_id, sampling=sp)
    out.token_ids.ids.extend(ids)
    heads = {**rename.heads, "prompt": "messages", "logprobs": "top_logprobs"}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Translated(
        out, FieldRename(heads, rename.scalar | {"prompt"}), req.stream, include_usage, logprobs
    )
