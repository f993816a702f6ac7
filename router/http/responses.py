"""`GenerateResponse` stream -> OpenAI response objects. Runs in the router process.

One formatter per request: `chunks(resp)` gives the streaming chunks for one message of the
lifecycle's stream, `add(resp)` accumulates it for a whole (non-streaming) answer, `whole()`
and `usage_chunk()` build the rest. Chunk rules (as OpenAI sends them):

- completions: one chunk per message that carries text, logprobs or the finish reason; the
  last one has `finish_reason`;
- chat: the first chunk is ``delta: {"role": "assistant", "content": ""}``, then one chunk per
  message with text or logprobs, then ``delta: {}`` with `finish_reason`;
- with ``stream_options.include_usage`` every chunk has ``"usage": null`` and one more chunk
  with ``"choices": []`` and the usage comes last;
- the chunk with the `finish_reason` (and a whole answer) carries pdserve's extension
  ``"pdserve": {"prefill_path", "prefill_path_reason"}`` (`pdserve_of`); other chunks leave
  the key out.

Tools (a chat request that offered them, `router.http.tools`): the text goes through a
`ToolCallParser`; content before a ``<tool_call>`` block is content, each complete block's
calls are `message.tool_calls` (streamed as tool-call deltas: id, type and name with empty
arguments, then the arguments), and a request that ended normally with calls has
``finish_reason: "tool_calls"``. A block cut off by `max_tokens` is content, and the finish
reason stays ``length``.

Logprobs: completions use the legacy parallel lists (`tokens`, `token_logprobs`,
`top_logprobs` as ``{token: logprob}``, `text_offset`); chat uses ``content: [{token,
logprob, bytes, top_logprobs: [...]}]``. A token's text is its own decoding (special tokens
kept), so a token holding part of a UTF-8 character shows U+FFFD, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel

from model_runtime.tokenizer import Tokenizer
from proto.pdserve.v1 import inference_pb2
from router.http.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    PdserveInfo,
    PromptTokensDetails,
    ResponseToolCall,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from router.http.tools import ToolCallParser, call_deltas


def usage_of(final: inference_pb2.FinalInfo) -> Usage:
    u = final.usage
    return Usage(
        prompt_tokens=u.prompt_tokens,
        completion_tokens=u.completion_tokens,
        total_tokens=u.prompt_tokens + u.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=u.cached_tokens),
    )


_PATHS: dict[str, Literal["local", "remote"] | None] = {
    "": None,
    "local": "local",
    "remote": "remote",
}


def pdserve_of(final: inference_pb2.FinalInfo) -> PdserveInfo:
    """The response's `pdserve` extension from the final message (an empty path, colocated
    mode, is null)."""
    assert final.prefill_path in _PATHS, f"FinalInfo.prefill_path {final.prefill_path!r}"
    return PdserveInfo(
        prefill_path=_PATHS[final.prefill_path],
        prefill_path_reason=final.prefill_path_reason or None,
    )


def dump(obj: BaseModel, include_usage: bool) -> str:
    """A chunk's JSON; `usage` appears (null until the last chunk) only when asked for;
    `pdserve` only on the chunk that has it (the one with the finish reason)."""
    exclude = set() if include_usage else {"usage"}
    if getattr(obj, "pdserve", None) is None:
        exclude.add("pdserve")
    return obj.model_dump_json(exclude=exclude or None)


class _Formatter:
    """Shared state: ids, the accumulated answer, token text for logprobs."""

    def __init__(
        self, rid: str, created: int, model: str, tokenizer: Tokenizer, logprobs: int | None
    ) -> None:
        self.id, self.created, self.model = rid, created, model
        self._tok = tokenizer
        self.logprobs = logprobs
        self.text: list[str] = []
        self.final: inference_pb2.FinalInfo | None = None
        self._offset = 0  # characters of token text so far (completions' text_offset)

    def add(self, resp: inference_pb2.GenerateResponse) -> None:
        """Accumulate one message for the whole answer."""
        self.text.append(resp.text)
        self._add_logprobs(resp)
        if resp.HasField("final"):
            self.final = resp.final

    def _add_logprobs(self, resp: inference_pb2.GenerateResponse) -> None:
        raise NotImplementedError

    def token_text(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def usage(self) -> Usage:
        assert self.final is not None, "usage before the final message"
        return usage_of(self.final)


class CompletionFormatter(_Formatter):
    """`/v1/completions` answers (`text_completion` objects)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._lp = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])

    def _logprobs(self, resp: inference_pb2.GenerateResponse) -> CompletionLogprobs | None:
        if self.logprobs is None:
            return None
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for tok, lp in zip(resp.token_ids, resp.logprobs, strict=True):
            text = self.token_text(tok)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob)
            out.top_logprobs.append({self.token_text(t.token_id): t.logprob for t in lp.top})
            out.text_offset.append(self._offset)
            self._offset += len(text)
        return out

    def _add_logprobs(self, resp: inference_pb2.GenerateResponse) -> None:
        part = self._logprobs(resp)
        if part is not None:
            self._lp.tokens.extend(part.tokens)
            self._lp.token_logprobs.extend(part.token_logprobs)
            self._lp.top_logprobs.extend(part.top_logprobs)
            self._lp.text_offset.extend(part.text_offset)

    def chunks(self, resp: inference_pb2.GenerateResponse) -> Sequence[BaseModel]:
        final = resp.final if resp.HasField("final") else None
        if final is not None:
            self.final = final
        logprobs = self._logprobs(resp)
        if not resp.text and logprobs is None and final is None:
            return ()
        choice = CompletionChoice(
            text=resp.text,
            logprobs=logprobs,
            finish_reason=final.finish_reason if final is not None else None,
        )
        info = pdserve_of(final) if final is not None else None
        return (self._object([choice], pdserve=info),)

    def _object(
        self,
        choices: list[CompletionChoice],
        usage: Usage | None = None,
        pdserve: PdserveInfo | None = None,
    ) -> BaseModel:
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            pdserve=pdserve,
        )

    def whole(self) -> BaseModel:
        assert self.final is not None, "whole() before the final message"
        choice = CompletionChoice(
            text="".join(self.text),
            logprobs=self._lp if self.logprobs is not None else None,
            finish_reason=self.final.finish_reason,
        )
        return self._object([choice], self.usage(), pdserve_of(self.final))

    def usage_chunk(self) -> BaseModel:
        return self._object([], self.usage())


class ChatFormatter(_Formatter):
    """`/v1/chat/completions` answers (`chat.completion` / `chat.completion.chunk`)."""

    def __init__(self, *args: object, parse_tools: bool = False, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._content: list[TokenLogprob] = []
        self._started = False
        self._tools = ToolCallParser() if parse_tools else None

    def _logprobs(self, resp: inference_pb2.GenerateResponse) -> ChatLogprobs | None:
        if self.logprobs is None:
            return None
        content = []
        for tok, lp in zip(resp.token_ids, resp.logprobs, strict=True):
            text = self.token_text(tok)
            top = []
            for t in lp.top:
                alt = self.token_text(t.token_id)
                top.append(TopLogprob(token=alt, logprob=t.logprob, bytes=list(alt.encode())))
            content.append(
                TokenLogprob(
                    token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    def _add_logprobs(self, resp: inference_pb2.GenerateResponse) -> None:
        part = self._logprobs(resp)
        if part is not None:
            self._content.extend(part.content)

    def _chunk(self, choice: ChatChunkChoice, pdserve: PdserveInfo | None = None) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice], pdserve=pdserve
        )

    def chunks(self, resp: inference_pb2.GenerateResponse) -> Sequence[BaseModel]:
        out: list[BaseModel] = []
        if not self._started:
            self._started = True
            out.append(self._chunk(ChatChunkChoice(delta=ChatDelta(role="assistant", content=""))))
        logprobs = self._logprobs(resp)
        text, calls = resp.text, list[ResponseToolCall]()
        deltas: list[ToolCallDelta] = []
        if self._tools is not None:
            before = len(self._tools.calls)
            text, calls = self._tools.push(resp.text)
            if resp.HasField("final"):
                text += self._tools.finish()
            deltas = call_deltas(calls, before)
        if text or logprobs is not None:
            delta = ChatDelta(content=text)
            out.append(self._chunk(ChatChunkChoice(delta=delta, logprobs=logprobs)))
        if calls:
            out.append(self._chunk(ChatChunkChoice(delta=ChatDelta(tool_calls=deltas))))
        if resp.HasField("final"):
            self.final = resp.final
            reason = self._finish_reason(resp.final.finish_reason)
            end = ChatChunkChoice(delta=ChatDelta(), finish_reason=reason)
            out.append(self._chunk(end, pdserve_of(resp.final)))
        return out

    def _finish_reason(self, reason: str) -> str:
        """``tool_calls`` for an answer that ended normally with calls."""
        called = self._tools is not None and self._tools.calls
        return "tool_calls" if called and reason == "stop" else reason

    def whole(self) -> BaseModel:
        assert self.final is not None, "whole() before the final message"
        text: str | None = "".join(self.text)
        calls = None
        if self._tools is not None:
            text, calls = self._tools.parse(text or "")
        choice = ChatChoice(
            message=AssistantMessage(content=text, tool_calls=calls or None),
            logprobs=ChatLogprobs(content=self._content) if self.logprobs is not None else None,
            finish_reason=self._finish_reason(self.final.finish_reason),
        )
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=[choice],
            usage=self.usage(),
            pdserve=pdserve_of(self.final),
        )

    def usage_chunk(self) -> BaseModel:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=self.usage()
        )
