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
  template writes its own special tokens). The content is bounded first, before any render
  (`ModelLimits.max_prompt_chars`, the same bound a text prompt gets: a 400 naming
  ``messages[i].content``), and so is the rendered text; `chat_request` does the rendering and
  tokenizing, so the handler runs it on the lifecycle's tokenizer threads, never on the event
  loop. A body too large to parse at all is refused unparsed (`oversized_body`);
- keep values protobuf cannot hold (negative seeds, > int32) from reaching it: they get the
  validation's own message.
"""

from __future__ import annotations

from dataclasses import dataclass

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2
from router.http.body_scan import oversized_content
from router.http.chat_template import ChatTemplate, ChatTemplateError
from router.http.errors import FieldRename, OpenAIError
from router.http.protocol import (
    NEUTRAL_ONLY,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingRequest,
)
from router.http.structured import Structured, structured_of
from router.http.tools import render_messages, supports_tools, tool_use, tools_json
from router.validation import MAX_SEED, ModelLimits

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
    parse_tools: bool = False  # chat with tools offered: look for calls in the output


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
    req: SamplingRequest, max_tokens: int | None, max_name: str, forced: Structured | None = None
) -> tuple[inference_pb2.SamplingParams, FieldRename]:
    """The request's `SamplingParams`; `forced`: a tool call the request's `tool_choice`
    demands (exclusive with the request's own structured-output fields)."""
    _check_neutral(req)
    structured = structured_of(req)
    if forced is not None and structured.message is not None:
        field = next(iter(structured.rename.values()))
        raise OpenAIError.invalid(field, "not with a tool_choice that forces a call")
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
    if req.speculative is not None:
        sp.speculative = req.speculative
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    sp.stop.extend(stops)
    scalar = frozenset({"stop"}) if isinstance(req.stop, str) else frozenset()
    constraint = forced or structured
    if constraint.message is not None:
        sp.structured_outputs.CopyFrom(constraint.message)
    return sp, FieldRename({"max_tokens": max_name, **constraint.rename}, scalar)


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


def oversized_body(raw: bytes, limits: ModelLimits, chat: bool) -> OpenAIError:
    """The 400 for a request body beyond `limits.max_json_body_bytes`, decided unparsed from
    `raw`, its first bytes (the bound + 1 of them, or all): for a chat body, naming
    ``messages[i].content`` where the content outgrows what the context can hold
    (`body_scan`), else naming the prompt field."""
    ctx, chars = limits.context_length, limits.max_prompt_chars
    if chat:
        i = oversized_content(raw, 12 * chars + 2, prefix=True)
        if i is not None:
            return OpenAIError.invalid(
                f"messages[{i}].content",
                f"too long: the messages' content up to here is over {12 * chars + 2} bytes of "
                f"JSON; the context length {ctx} allows at most {chars} characters",
            )
    return OpenAIError.invalid(
        "messages" if chat else "prompt",
        f"too long: the request body is over {limits.max_json_body_bytes} bytes, the most a "
        f"request that fits the context length {ctx} can take",
    )


def check_chat_content(req: ChatCompletionRequest, limits: ModelLimits) -> None:
    """Refuse messages whose content cannot fit the context, before rendering them: a 400
    naming ``messages[i].content``, the first message at which the running total of content
    characters passes `limits.max_prompt_chars` (0: no bound)."""
    bound = limits.max_prompt_chars
    if not bound:
        return
    total = 0
    for i, m in enumerate(req.messages):
        total += len(m.text())
        if total > bound:
            raise OpenAIError.invalid(
                f"messages[{i}].content",
                f"too long: the messages' content up to here is {total} characters; the "
                f"context length {limits.context_length} allows at most {bound} characters",
            )


def chat_request(
    req: ChatCompletionRequest,
    request_id: str,
    template: ChatTemplate | None,
    tokenizer: Tokenizer,
    limits: ModelLimits,
    model_dir: str,
    default_max_tokens: int | None = None,
) -> Translated:
    """`/v1/chat/completions` -> `GenerateRequest`: messages bounded (`check_chat_content`),
    rendered and tokenized here — seconds of CPU for a long conversation, so the caller runs
    it off the event loop. Without a max_tokens, `default_max_tokens` (None: the rest of the
    context) applies. Raises `OpenAIError` (400) naming the field at fault."""
    context_length = limits.context_length
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
    tools = tool_use(req)
    sp, rename = _sampling(req, max_tokens, max_name, tools.forced)
    logprobs: int | None = None
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError.invalid("top_logprobs", "only allowed with logprobs: true")
    if req.logprobs:
        logprobs = _int32("top_logprobs", req.top_logprobs or 0)
        sp.logprobs = logprobs
    check_chat_content(req, limits)
    try:
        if tools.offered and not supports_tools(template.source):
            text = template.render(render_messages(req.messages, tools.offered))
        else:
            text = template.render(req.messages, tools=tools_json(tools.offered) or None)
    except ChatTemplateError as exc:
        raise OpenAIError.invalid("messages", str(exc)) from exc
    if limits.max_prompt_chars and len(text) > limits.max_prompt_chars:
        raise OpenAIError.invalid(
            "messages",
            f"too long: the rendered prompt is {len(text)} characters; the context length "
            f"{context_length} allows at most {limits.max_prompt_chars} characters",
        )
    ids = tokenizer.encode(text, add_bos=False)
    if max_tokens is None:  # OpenAI: up to the rest of the context
        sp.max_tokens = max(1, context_length - len(ids))
        if default_max_tokens is not None:
            sp.max_tokens = min(sp.max_tokens, default_max_tokens)
    out = inference_pb2.GenerateRequest(request_id=request_id, sampling=sp)
    out.token_ids.ids.extend(ids)
    heads = {**rename.heads, "prompt": "messages", "logprobs": "top_logprobs"}
    include_usage = req.stream_options is not None and req.stream_options.include_usage
    return Translated(
        out,
        FieldRename(heads, rename.scalar | {"prompt"}),
        req.stream,
        include_usage,
        logprobs,
        parse_tools=tools.parse,
    )
