"""OpenAI tools for chat: the prompt that offers them, the grammar that forces a call, and the
parser that finds calls in the output. Runs in the router process (HTTP front).

The call format is the one SmolLM2's instruct data teaches (and Hermes-style models share):
a JSON list of calls inside tags,

    <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]</tool_call>

(a single JSON object inside the tags, Hermes' form, parses too).

- **Prompt** (`render_messages`): a template that knows tools (its source uses ``tools``) gets
  them as `tools`, the Hugging Face way. One that does not (SmolLM2's) gets the function
  definitions in a system message in the format above, prepended to the conversation's own
  system message; earlier assistant `tool_calls` are written back in the call format and
  tool results as ``<tool_response>`` user turns.
- **Choice**: ``none`` offers no tools and parses nothing; ``auto`` (the default) offers them
  and parses the output; ``required`` and a named function also constrain decoding with
  `call_grammar`, so the output *is* a call whose arguments validate against the function's
  `parameters` (`strict` false drops schema keywords the engine cannot enforce; properties
  and items the parameters leave open are closed, `model_runtime.closed_schema`): one call to
  the named function, or up to `MAX_PARALLEL_CALLS` for ``required`` (one with
  ``parallel_tool_calls: false``).
- **Parsing** (`ToolCallParser`): text before the first ``<tool_call>`` is content; each
  complete block's calls become `tool_calls` (ids ``call_<hex>``). A block cut off by
  `max_tokens` is not a call: it stays content, and the finish reason stays ``length``.
  Streaming holds back only what could still become a ``<tool_call>`` tag and emits each call
  as OpenAI does: one delta with its id, type and name (arguments ``""``), then one with its
  arguments.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from model_runtime.closed_schema import closed
from model_runtime.structured import JSON_OPTIONS
from proto.pdserve.v1 import inference_pb2
from router.http.errors import OpenAIError
from router.http.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionDelta,
    NamedToolChoice,
    ResponseFunctionCall,
    ResponseToolCall,
    Tool,
    ToolCallDelta,
)
from router.http.structured import Structured

OPEN, CLOSE = "<tool_call>", "</tool_call>"

SYSTEM_PROMPT = (
    "You are an expert in composing functions. You are given a question and a set of possible "
    "functions. Based on the question, you will need to make one or more function/tool calls "
    "to achieve the purpose. If none of the functions can be used, point it out and refuse to "
    "answer. If the given question lacks the parameters required by the function, also point "
    "it out.\n\nYou have access to the following tools:\n<tools>{tools}</tools>\n\nThe output "
    "MUST strictly adhere to the following format, and NO other text MUST be included.\nThe "
    "example format is as follows. Please make sure the parameter type is correct. If no "
    "function call is needed, please make the tool calls an empty list '[]'.\n<tool_call>[\n"
    '{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},\n'
    "... (more tool calls as required)\n]</tool_call>"
)
"""SmolLM2's function-calling system prompt (its instruct data's wording)."""


@dataclass(frozen=True)
class ToolUse:
    """What a chat request's tools mean for it: the tools offered in the prompt (none for
    ``tool_choice: none``), whether the output is parsed for calls, and the constraint that
    forces a call (``required`` / named)."""

    offered: list[Tool] = field(default_factory=list)
    parse: bool = False
    forced: Structured | None = None


def tool_use(req: ChatCompletionRequest) -> ToolUse:
    """The request's `ToolUse`; 400 naming `tool_choice` for a function it does not define, or
    a choice other than ``none`` without tools."""
    tools = req.tools or []
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none":
        return ToolUse()
    if not tools:
        raise OpenAIError.invalid("tool_choice", f"{_choice_name(choice)} needs tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise OpenAIError.invalid("tools", "function names must be unique")
    if choice == "auto":
        return ToolUse(tools, parse=True)
    if isinstance(choice, NamedToolChoice):
        chosen = [t for t in tools if t.function.name == choice.function.name]
        if not chosen:
            raise OpenAIError.invalid(
                "tool_choice.function.name",
                f"{choice.function.name!r} is not one of the tools: {names}",
            )
    else:
        chosen = tools
    # a named function is one call; "required" may make several, unless told not to
    parallel = req.parallel_tool_calls is not False and not isinstance(choice, NamedToolChoice)
    grammar = call_grammar(chosen, parallel)
    msg = inference_pb2.StructuredOutputs(grammar=grammar)
    rename = {"structured_outputs.grammar": "tools"}
    return ToolUse(tools, parse=True, forced=Structured(msg, rename))


def _choice_name(choice: object) -> str:
    return f"tool_choice {choice!r}" if isinstance(choice, str) else "a named tool_choice"


MAX_PARALLEL_CALLS = 4
"""Most calls one forced answer may hold with `parallel_tool_calls` (a small model asked for
"one or more" may otherwise repeat a call until `max_tokens`)."""


def _rewrite_refs(node: Any, prefix: str) -> Any:
    """`node` with every local `$ref` (``#``, ``#/$defs/X``, ``#/definitions/X``) pointing
    into the root's ``$defs`` under `prefix` (the parameters schema is embedded in a larger
    one, whose root is not its own)."""
    if isinstance(node, list):
        return [_rewrite_refs(v, prefix) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite_refs(v, prefix) for k, v in node.items()}
    ref = out.get("$ref")
    if isinstance(ref, str):
        if ref == "#":
            out["$ref"] = f"#/$defs/{prefix}"
        else:
            for head in ("#/$defs/", "#/definitions/"):
                if ref.startswith(head):
                    out["$ref"] = f"#/$defs/{prefix}.{ref[len(head) :]}"
    return out


def _call_schema(tool: Tool, defs: dict[str, Any]) -> dict[str, Any]:
    """The schema of one call to `tool`; its parameters (closed: `closed_schema`, as a
    ``json`` constraint's schema is) and their definitions move into `defs`."""
    name = tool.function.name
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    params = _rewrite_refs(closed(parameters), name)
    for key in ("$defs", "definitions"):
        for sub, schema in (params.pop(key, None) or {}).items():
            defs[f"{name}.{sub}"] = schema
    defs[name] = params
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": {"$ref": f"#/$defs/{name}"}},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def call_grammar(tools: list[Tool], parallel: bool) -> str:
    """A Lark grammar (llguidance's dialect) whose only sentences are a call block of one
    (or, with `parallel`, up to `MAX_PARALLEL_CALLS`) calls to `tools`, arguments valid
    against each function's `parameters` (their `$defs` kept). Strict unless every tool says
    ``strict: false``."""
    lenient = all(t.function.strict is False for t in tools)
    defs: dict[str, Any] = {}
    items = {"anyOf": [_call_schema(t, defs) for t in tools]}
    schema: dict[str, Any] = {
        "$defs": defs,
        "type": "array",
        "items": items,
        "minItems": 1,
        "maxItems": MAX_PARALLEL_CALLS if parallel else 1,
        "x-guidance": dict(JSON_OPTIONS, lenient=lenient),
    }
    return f"start: {json.dumps(OPEN)} calls {json.dumps(CLOSE)}\ncalls: %json {json.dumps(schema)}"


# ---------------------------------------------------------------------------------- prompt


def supports_tools(template_source: str) -> bool:
    """Whether a chat template renders `tools` itself."""
    return "tools" in template_source


def tools_json(tools: list[Tool]) -> list[dict[str, Any]]:
    """The tools as the template / system prompt shows them (OpenAI's own shape)."""
    return [
        {"type": "function", "function": t.function.model_dump(exclude_none=True)} for t in tools
    ]


def _calls_text(message: ChatMessage) -> str:
    calls = []
    for c in message.tool_calls or []:
        try:
            args: Any = json.loads(c.function.arguments)
        except json.JSONDecodeError:
            args = c.function.arguments
        calls.append({"name": c.function.name, "arguments": args})
    return f"{OPEN}{json.dumps(calls)}{CLOSE}"


def render_messages(messages: list[ChatMessage], tools: list[Tool]) -> list[ChatMessage]:
    """`messages` for a template without tool support (module docstring): the tools' system
    prompt first (joined with the conversation's own system message), assistant calls in the
    call format, tool results as ``<tool_response>`` user turns."""
    out: list[ChatMessage] = []
    system = SYSTEM_PROMPT.format(tools=json.dumps(tools_json(tools))) if tools else ""
    rest = messages
    if messages[0].role in ("system", "developer") and system:
        system += "\n\n" + messages[0].text()
        rest = messages[1:]
    if system:
        out.append(ChatMessage(role="system", content=system))
    for m in rest:
        if m.role == "assistant" and m.tool_calls:
            text = (m.text() + "\n" if m.text() else "") + _calls_text(m)
            out.append(ChatMessage(role="assistant", content=text))
        elif m.role == "tool":
            out.append(
                ChatMessage(role="user", content=f"<tool_response>\n{m.text()}\n</tool_response>")
            )
        else:
            out.append(m)
    return out


# ---------------------------------------------------------------------------------- parsing


def _new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_in(block: str) -> list[ResponseToolCall] | None:
    """The calls of one block's inner text, or None when it is not a list (or one) of
    ``{"name": str, "arguments": object}``."""
    try:
        value = json.loads(block)
    except json.JSONDecodeError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        args = item.get("arguments", item.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args)
        calls.append(
            ResponseToolCall(
                id=_new_id(), function=ResponseFunctionCall(name=item["name"], arguments=text)
            )
        )
    return calls


@dataclass
class ToolCallParser:
    """Splits a chat answer into content and tool calls (module docstring). `push` text as it
    comes (streaming) and `finish` once; or `parse` a whole answer."""

    content: list[str] = field(default_factory=list)  # content released so far
    calls: list[ResponseToolCall] = field(default_factory=list)
    _pending: str = ""  # text held back: a possible tag start, or an open block

    def push(self, text: str) -> tuple[str, list[ResponseToolCall]]:
        """Content safe to release now and the calls completed by `text`."""
        self._pending += text
        released: list[str] = []
        new_calls: list[ResponseToolCall] = []
        while True:
            start = self._pending.find(OPEN)
            if start < 0:
                keep = _partial_tag(self._pending)
                released.append(self._pending[: len(self._pending) - keep])
                self._pending = self._pending[len(self._pending) - keep :]
                break
            end = self._pending.find(CLOSE, start + len(OPEN))
            if end < 0:
                released.append(self._pending[:start])
                self._pending = self._pending[start:]
                break
            calls = _calls_in(self._pending[start + len(OPEN) : end])
            if calls is None:  # not a call: it is content after all
                released.append(self._pending[: end + len(CLOSE)])
            else:
                released.append(self._pending[:start])
                new_calls += calls
            self._pending = self._pending[end + len(CLOSE) :]
        out = "".join(released)
        self.content.append(out)
        self.calls += new_calls
        return out, new_calls

    def finish(self) -> str:
        """The rest: an unfinished block (cut by `max_tokens`) or tag prefix is content."""
        rest, self._pending = self._pending, ""
        self.content.append(rest)
        return rest

    def parse(self, text: str) -> tuple[str | None, list[ResponseToolCall]]:
        """A whole answer: (content, None when only calls and whitespace; calls)."""
        self.push(text)
        self.finish()
        content = "".join(self.content)
        if self.calls and not content.strip():
            return None, self.calls
        return content.strip() if self.calls else content, self.calls


def _partial_tag(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if OPEN.startswith(text[-n:]):
            return n
    return 0


def call_deltas(calls: list[ResponseToolCall], first_index: int) -> list[ToolCallDelta]:
    """Each call as OpenAI streams it: id, type and name with empty arguments, then the
    arguments."""
    out = []
    for k, c in enumerate(calls):
        i = first_index + k
        out.append(
            ToolCallDelta(
                index=i,
                id=c.id,
                type="function",
                function=FunctionDelta(name=c.function.name, arguments=""),
            )
        )
        out.append(ToolCallDelta(index=i, function=FunctionDelta(arguments=c.function.arguments)))
    return out
