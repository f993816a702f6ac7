"""OpenAI API request and response schemas (pydantic v2). Runs in the router process.

Requests are strict and closed: a field pdserve does not implement is refused with a 400 that
names it (`extra="forbid"`), never silently ignored. Fields OpenAI defines that change nothing
at one value (`n`, `presence_penalty`, ...) are accepted at that value only (`NEUTRAL_ONLY`,
checked by `router.http.translate`). `user` is accepted: it is an end-user id for the caller's
own abuse tracking, not an instruction.

Engine extensions, as vLLM and SGLang accept them: `top_k` (-1 or 0 = off), `min_tokens`,
`ignore_eos`, pdserve's `speculative` (false: no speculative decoding for this request; the
tokens are the same either way), and structured output beyond `response_format` under vLLM's
names:
`structured_outputs` (``{"json" | "regex" | "choice" | "grammar" | "json_object": ...}``) and
the older `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`.

Structured output and tools (`router.http.structured`, `router.http.tools`): `response_format`
(``text``, ``json_object``, ``json_schema`` with `strict`), `tools` (functions) with
`tool_choice` (``none``, ``auto``, ``required``, or a named function) and
`parallel_tool_calls`; assistant messages may carry `tool_calls`, tool messages
`tool_call_id`.

Responses follow OpenAI's shapes field for field; streaming chunks are the same objects sent
as Server-Sent Events (`router.http.handlers`). One extension, namespaced so no OpenAI field
is touched: `pdserve` (`PdserveInfo`: where the prompt was prefilled, and why) on a whole
answer and on the streamed chunk that carries the `finish_reason`; other chunks leave it out.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class StreamOptions(_Request):
    """`stream_options`: only with `stream: true`."""

    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """`response_format.json_schema`. `schema` is the JSON schema (`schema_` here: pydantic
    reserves the name)."""

    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """`response_format`: free text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Request):
    """vLLM's `structured_outputs` extension: exactly one of these."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingRequest(_Request):
    """What completions and chat share."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int | None = None
    speculative: bool | None = None
    user: str | None = None
    # Accepted at their neutral value only (see NEUTRAL_ONLY).
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    # Structured output (router.http.structured).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingRequest):
    """`POST /v1/completions`. `prompt`: text, token ids, or a list with one such item."""

    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(_Request):
    """A text part of a message's `content` list (other part types are refused)."""

    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """A call's function: its name and its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(_Request):
    """One tool call of an assistant message (as the API returned it earlier)."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages
    tool_call_id: str | None = None  # tool messages: the call this answers

    def text(self) -> str:
        """`content` as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class FunctionDefinition(_Request):
    """A tool's function: `parameters` is the JSON schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """`tool_choice` naming one function: the model must call it."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    """`POST /v1/chat/completions`; `messages` are rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


NEUTRAL_ONLY: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "echo": False,
    "best_of": None,
    "suffix": None,
}
"""Fields accepted only at the value that changes nothing (an empty `logit_bias` and
`best_of: 1` count as neutral too)."""


# ---------------------------------------------------------------------------------- responses


class _Response(BaseModel):
    model_config = ConfigDict(frozen=True)


class PromptTokensDetails(_Response):
    cached_tokens: int


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PdserveInfo(_Response):
    """pdserve's extension of a response (`pdserve`), from the gRPC `FinalInfo`.

    `prefill_path`: in a disaggregated cluster, ``"remote"`` (a prefill worker computed the
    prompt's KV and sent it to the decode worker) or ``"local"`` (the decode worker prefilled
    it itself, `[router.hybrid]`); null in colocated mode, where there is one worker.
    `prefill_path_reason`: why (`router.hybrid.PathReason`: ``off``, ``decode_busy``,
    ``spill``, ``long_prompt`` for remote; ``short_prompt``, ``prefill_busy`` for local); null
    with it."""

    prefill_path: Literal["local", "remote"] | None = None
    prefill_path_reason: str | None = None


class CompletionLogprobs(_Response):
    """Legacy completions logprobs: parallel lists, one entry per generated token;
    `text_offset` counts characters from the start of the completion."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None


class CompletionResponse(_Response):
    """A whole completion, or one streamed chunk of it (same object, as OpenAI sends)."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    pdserve: PdserveInfo | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[TokenLogprob]


class ResponseFunctionCall(_Response):
    name: str
    arguments: str  # JSON text


class ResponseToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class AssistantMessage(_Response):
    """A whole answer's message: `content` null when the model called tools only."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ResponseToolCall] | None = None

    @model_serializer
    def _without_empty_tool_calls(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    pdserve: PdserveInfo


class FunctionDelta(_Response):
    """A streamed piece of a call's function: its name once (first piece), then arguments
    text to append."""

    name: str | None = None
    arguments: str | None = None

    @model_serializer
    def _without_unset(self) -> dict[str, str]:
        pairs = (("name", self.name), ("arguments", self.arguments))
        return {k: v for k, v in pairs if v is not None}


class ToolCallDelta(_Response):
    """A streamed piece of tool call `index`: `id` and `type` on its first piece only."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionDelta

    @model_serializer
    def _without_unset(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"], out["type"] = self.id, self.type or "function"
        out["function"] = self.function.model_dump()
        return out


class ChatDelta(_Response):
    """A streamed message delta; unset keys are left out (the last chunk's delta is `{}`)."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None

    @model_serializer
    def _without_unset(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            k: v for k, v in (("role", self.role), ("content", self.content)) if v is not None
        }
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        return out


class ChatChunkChoice(_Response):
    index: int = 0
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    pdserve: PdserveInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pdserve"
    max_model_len: int
    # pdserve's extension: what the served weights are, e.g. "Q4_1+Q8_0" (kept quantized) or
    # "bfloat16" (`ModelConfig.weights_label`)
    weights: str


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo
