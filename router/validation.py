"""Validation of public `GenerateRequest`s. Runs in the router process, before any worker call.

`decode_generate_request(bytes)` is the gRPC request deserializer: it never raises, so a request
that protobuf refuses (a proto3 `string` with invalid UTF-8 raises `DecodeError` at parse time;
grpc's default deserializer would answer INTERNAL) still reaches the handler, which answers
INVALID_ARGUMENT naming the field; a request over the model's size limit is refused unparsed.
Text prompts longer than the context can hold are refused before they are tokenized.
`validate_request` turns a decoded request into a `ValidatedRequest` or raises
`RequestValidationError` (a ValueError) whose message starts with the offending field's path,
e.g. ``sampling.top_p: must be in (0, 1], got 1.5``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Container
from dataclasses import dataclass
from functools import cache
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message, message_factory
from google.protobuf.unknown_fields import UnknownFieldSet

from model_runtime.sampling_params import GREEDY_BELOW, MAX_LOGPROBS, SamplingParams
from model_runtime.structured import StructuredOutput
from proto.pdserve.v1 import inference_pb2

DEFAULT_MAX_TOKENS = 16
MAX_REQUEST_ID_CHARS = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
MAX_SEED = 2**63 - 1  # SamplingParams / torch generators take signed 64-bit seeds


class RequestValidationError(ValueError):
    """Bad client input. `field` is the offending field's path (`sampling.top_p`)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


@dataclass(frozen=True)
class ModelLimits:
    """What the served model allows; read once at router start-up (`for_model`).

    `max_prompt_chars` bounds a text prompt before it is tokenized: no token covers more than
    the tokenizer's longest vocabulary entry (`max_token_chars` characters), so a longer text
    cannot fit in `context_length - 1` tokens (twice that, for normalizers that drop
    characters). `max_request_bytes` bounds a whole serialized request: such a text in UTF-8
    (4 bytes a character at most), every context token as a 10-byte varint, and 64 KiB for the
    rest. 0 means no bound (tests that build limits by hand).

    `max_json_body_bytes` is the same bound for an HTTP JSON body (`/v1/completions`,
    `/v1/chat/completions`): such a text JSON-escaped (12 bytes a character at most: an astral
    character is two ``\\uXXXX`` escapes), 64 bytes per context token (a token id with its
    separator and whitespace, or one chat message's keys and role), and 64 KiB for the rest.
    A body beyond it cannot hold a request the model can serve, so the HTTP front refuses it
    before parsing it (parsing a large JSON body holds the GIL, i.e. the event loop).
    """

    vocab_size: int
    context_length: int
    max_prompt_chars: int = 0
    max_request_bytes: int = 0

    @classmethod
    def for_model(cls, vocab_size: int, context_length: int, max_token_chars: int) -> ModelLimits:
        chars = 2 * max(1, max_token_chars) * (context_length - 1)
        return cls(vocab_size, context_length, chars, 4 * chars + 10 * context_length + 65536)

    @property
    def max_json_body_bytes(self) -> int:
        """Largest HTTP JSON body worth parsing (class docstring); 0: no bound."""
        if not self.max_prompt_chars:
            return 0
        return 12 * self.max_prompt_chars + 64 * self.context_length + 65536


@dataclass(frozen=True)
class DecodedRequest:
    """The deserializer's result: a parsed message, or the error that stopped parsing.

    `prompt_fields` counts the top-level `text`/`token_ids` fields on the wire: protobuf keeps
    only the last member of a oneof, so "both prompt kinds set" is visible only here.
    """

    message: inference_pb2.GenerateRequest | None
    error: RequestValidationError | None = None
    prompt_fields: frozenset[int] = frozenset()


@dataclass(frozen=True)
class ValidatedRequest:
    """A request the router may route: prompt tokenized, every limit checked."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    stop: tuple[str, ...]


def _top_level_fields(data: bytes) -> frozenset[int]:
    """Field numbers present at the top level of a serialized message (bounded scan)."""
    seen: set[int] = set()
    i, n = 0, len(data)

    def varint() -> int:
        nonlocal i
        shift = result = 0
        while i < n and shift < 64:
            byte = data[i]
            i += 1
            result |= (byte & 0x7F) << shift
            if not byte & 0x80:
                return result
            shift += 7
        raise ValueError("truncated varint")

    try:
        while i < n:
            tag = varint()
            seen.add(tag >> 3)
            wire = tag & 7
            if wire == 0:
                varint()
            elif wire == 1:
                i += 8
            elif wire == 2:
                length = varint()  # not `i += varint()`: that reads i before varint moves it
                i += length
            elif wire == 5:
                i += 4
            else:
                break  # groups: protobuf itself reports anything malformed
    except ValueError:
        pass
    return frozenset(seen)


@cache
def _bytes_twin() -> type[message.Message]:
    """`GenerateRequest` rebuilt with every `string` field as `bytes` (parses any UTF-8)."""
    fdp = descriptor_pb2.FileDescriptorProto()
    inference_pb2.DESCRIPTOR.CopyToProto(fdp)
    fdp.name = "pdserve/v1/inference_bytes_twin.proto"
    fdp.package = "pdserve.v1.bytestwin"
    fdp.ClearField("service")
    for msg in fdp.message_type:
        for fld in msg.field:
            if fld.type == descriptor_pb2.FieldDescriptorProto.TYPE_STRING:
                fld.type = descriptor_pb2.FieldDescriptorProto.TYPE_BYTES
            if fld.type_name.startswith(".pdserve.v1."):
                fld.type_name = fld.type_name.replace(".pdserve.v1.", ".pdserve.v1.bytestwin.", 1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(fdp)
    desc = pool.FindMessageTypeByName("pdserve.v1.bytestwin.GenerateRequest")
    return message_factory.GetMessageClass(desc)


def _utf8_culprit(data: bytes) -> str | None:
    """The path of the first string field holding invalid UTF-8, or None if none does."""
    twin: Any = _bytes_twin()()
    try:
        twin.ParseFromString(data)
    except message.DecodeError:
        return None
    candidates: list[tuple[str, bytes]] = [("request_id", twin.request_id), ("text", twin.text)]
    candidates += [(f"sampling.stop[{i}]", s) for i, s in enumerate(twin.sampling.stop)]
    for path, raw in candidates:
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError:
            return path
    return None


def decode_generate_request(data: bytes, max_bytes: int = 0) -> DecodedRequest:
    """gRPC request deserializer for `Generate`; never raises (errors travel in the result).
    A request over `max_bytes` (> 0) is refused by its size, naming the limit, unparsed."""
    if max_bytes and len(data) > max_bytes:
        err = RequestValidationError(
            "request", f"{len(data)} bytes; the limit is {max_bytes} bytes for this model"
        )
        return DecodedRequest(None, err)
    prompt_fields = _top_level_fields(data) & {2, 3}
    try:
        msg = inference_pb2.GenerateRequest.FromString(data)
    except message.DecodeError as exc:
        culprit = _utf8_culprit(data)
        if culprit is not None:
            err = RequestValidationError(culprit, "must be valid UTF-8")
        else:
            err = RequestValidationError("request", f"malformed protobuf message ({exc})")
        return DecodedRequest(None, err, prompt_fields)
    return DecodedRequest(msg, None, prompt_fields)


def decode_model_info_request(data: bytes) -> inference_pb2.GetModelInfoRequest | None:
    """gRPC request deserializer for `GetModelInfo`; None for bytes that do not parse (the
    handler answers INVALID_ARGUMENT) instead of raising (which grpc answers UNKNOWN)."""
    try:
        return inference_pb2.GetModelInfoRequest.FromString(data)
    except message.DecodeError:
        return None


_WIRE_TYPES = {0: "varint", 1: "64-bit", 2: "length-delimited", 3: "group", 4: "group", 5: "32-bit"}


def _check_unknown_fields(msg: message.Message, path: str) -> None:
    """Unknown fields are refused; a known field number among them arrived with the wrong wire
    type (protobuf keeps such a field as unknown): name that field."""
    unknown = UnknownFieldSet(msg)
    if not len(unknown):
        return
    fields = msg.DESCRIPTOR.fields_by_number
    for i in range(len(unknown)):
        number, wire = unknown[i].field_number, unknown[i].wire_type
        if number in fields:
            fld = fields[number]
            kind = (
                f"{fld.message_type.name} message"
                if fld.message_type
                else descriptor_pb2.FieldDescriptorProto.Type.Name(
                    descriptor_pb2.FieldDescriptorProto.Type.ValueType(fld.type)
                )[5:].lower()
            )
            raise RequestValidationError(
                f"{path}.{fld.name}" if path else fld.name,
                f"wrong wire type ({_WIRE_TYPES.get(wire, wire)}) for a {kind}",
            )
    numbers = sorted({unknown[i].field_number for i in range(len(unknown))})
    raise RequestValidationError(
        path or "request",
        f"unknown field number(s) {numbers} (client and server protos differ)",
    )


def _check_request_id(request_id: str, in_flight: Container[str]) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise RequestValidationError(
            "request_id", f"at most {MAX_REQUEST_ID_CHARS} characters, got {len(request_id)}"
        )
    if not request_id.isprintable():
        raise RequestValidationError("request_id", "must be printable characters only")
    check_not_in_flight(request_id, in_flight)


def check_not_in_flight(request_id: str, in_flight: Container[str]) -> None:
    """A client's request id must not name a request still running (empty ids are assigned
    later and never collide)."""
    if request_id and request_id in in_flight:
        raise RequestValidationError("request_id", f"{request_id!r} is already in flight")


def _prompt_ids(
    req: inference_pb2.GenerateRequest,
    prompt_fields: frozenset[int],
    encode: Callable[[str], list[int]],
    limits: ModelLimits,
) -> list[int]:
    if len(prompt_fields) > 1:
        raise RequestValidationError("prompt", "set exactly one of text or token_ids, got both")
    kind = req.WhichOneof("prompt")
    if kind is None:
        raise RequestValidationError("prompt", "set exactly one of text or token_ids, got neither")
    if kind == "text":
        if not req.text:
            raise RequestValidationError("text", "prompt text must not be empty")
        if limits.max_prompt_chars and len(req.text) > limits.max_prompt_chars:
            raise RequestValidationError(
                "text",
                f"prompt is {len(req.text)} characters; the context length "
                f"{limits.context_length} allows at most {limits.max_prompt_chars} characters",
            )
        ids = encode(req.text)
        field = "text"
    else:
        _check_unknown_fields(req.token_ids, "token_ids")
        field = "token_ids"
        n = len(req.token_ids.ids)
        if n >= limits.context_length:  # before touching each id: the count alone refuses it
            raise RequestValidationError(
                field,
                f"prompt is {n} tokens; the context length {limits.context_length} allows at "
                f"most {limits.context_length - 1} (one generated token must fit)",
            )
        ids = list(req.token_ids.ids)
        if not ids:
            raise RequestValidationError("token_ids.ids", "prompt token ids must not be empty")
        for i, tok in enumerate(ids):
            if not 0 <= tok < limits.vocab_size:
                raise RequestValidationError(
                    f"token_ids.ids[{i}]", f"must be in [0, {limits.vocab_size}), got {tok}"
                )
    if len(ids) >= limits.context_length:
        raise RequestValidationError(
            field,
            f"prompt is {len(ids)} tokens; the context length {limits.context_length} allows at "
            f"most {limits.context_length - 1} (one generated token must fit)",
        )
    return ids


def _check_stops(sp: inference_pb2.SamplingParams, limits: ModelLimits) -> None:
    if len(sp.stop) > MAX_STOP_STRINGS:
        raise RequestValidationError(
            "sampling.stop", f"at most {MAX_STOP_STRINGS} stop strings, got {len(sp.stop)}"
        )
    for i, stop in enumerate(sp.stop):
        if not stop:
            raise RequestValidationError(f"sampling.stop[{i}]", "stop strings must not be empty")
        if len(stop) > MAX_STOP_STRING_CHARS:
            raise RequestValidationError(
                f"sampling.stop[{i}]",
                f"at most {MAX_STOP_STRING_CHARS} characters, got {len(stop)}",
            )
    if len(sp.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise RequestValidationError(
            "sampling.stop_token_ids",
            f"at most {MAX_STOP_TOKEN_IDS} ids, got {len(sp.stop_token_ids)}",
        )
    for i, tok in enumerate(sp.stop_token_ids):
        if not 0 <= tok < limits.vocab_size:
            raise RequestValidationError(
                f"sampling.stop_token_ids[{i}]", f"must be in [0, {limits.vocab_size}), got {tok}"
            )


def _sampling(
    sp: inference_pb2.SamplingParams, num_prompt: int, limits: ModelLimits
) -> SamplingParams:
    room = limits.context_length - num_prompt  # >= 1, checked with the prompt
    if sp.HasField("max_tokens"):
        max_tokens = sp.max_tokens
        if max_tokens <= 0:
            raise RequestValidationError("sampling.max_tokens", f"must be >= 1, got {max_tokens}")
        if max_tokens > room:
            raise RequestValidationError(
                "sampling.max_tokens",
                f"prompt ({num_prompt}) + max_tokens ({max_tokens}) exceeds the context length "
                f"{limits.context_length}; at most {room}",
            )
    else:
        max_tokens = min(DEFAULT_MAX_TOKENS, room)
    temperature = sp.temperature if sp.HasField("temperature") else 0.0
    if not math.isfinite(temperature) or temperature < 0:
        raise RequestValidationError(
            "sampling.temperature", f"must be finite and >= 0 (0 = greedy), got {temperature}"
        )
    if temperature < GREEDY_BELOW:
        temperature = 0.0  # what the workers would do anyway: below it, sampling is greedy
    top_p = sp.top_p if sp.HasField("top_p") else 1.0
    if not 0.0 < top_p <= 1.0:
        raise RequestValidationError("sampling.top_p", f"must be in (0, 1], got {top_p}")
    top_k = sp.top_k if sp.HasField("top_k") else 0
    if top_k < 0:
        raise RequestValidationError("sampling.top_k", f"must be >= 0 (0 = off), got {top_k}")
    seed = sp.seed if sp.HasField("seed") else None
    if seed is not None and seed > MAX_SEED:
        raise RequestValidationError("sampling.seed", f"must be in [0, 2^63 - 1], got {seed}")
    _check_stops(sp, limits)
    logprobs = sp.logprobs if sp.HasField("logprobs") else None
    if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
        raise RequestValidationError(
            "sampling.logprobs", f"must be in [0, {MAX_LOGPROBS}], got {logprobs}"
        )
    min_tokens = sp.min_tokens if sp.HasField("min_tokens") else 0
    if not 0 <= min_tokens <= max_tokens:
        raise RequestValidationError(
            "sampling.min_tokens", f"must be in [0, max_tokens={max_tokens}], got {min_tokens}"
        )
    structured = _structured(sp)
    params = SamplingParams(
        structured=structured,
        max_tokens=max_tokens,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        stop_token_ids=tuple(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        min_tokens=min_tokens,
        logprobs=logprobs,
        speculative=sp.speculative if sp.HasField("speculative") else True,
    )
    params.validate(limits.vocab_size)  # the runtime's own rules; must agree with the above
    return params


def has_structured_output(req: inference_pb2.GenerateRequest) -> bool:
    """Whether `req` asks for structured output (its check compiles a grammar: tens of
    milliseconds at most, run off the event loop)."""
    return req.sampling.structured_outputs.WhichOneof("constraint") is not None


def _structured(sp: inference_pb2.SamplingParams) -> StructuredOutput | None:
    """`sampling.structured_outputs` as a checked constraint (`StructuredOutput.check`: the
    grammar engine validates it under its limits), or None."""
    msg = sp.structured_outputs
    _check_unknown_fields(msg, "sampling.structured_outputs")
    kind = msg.WhichOneof("constraint")
    field = f"sampling.structured_outputs.{kind}"
    if kind == "json_object" and not msg.json_object:
        raise RequestValidationError(field, "must be true when set")
    if msg.lenient and kind != "json":
        raise RequestValidationError(
            "sampling.structured_outputs.lenient", "only with a json constraint"
        )
    if kind is None:
        return None
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    so = StructuredOutput.of(kind, value, lenient=msg.lenient)
    try:
        so.check(field)
    except ValueError as exc:
        raise RequestValidationError(field, str(exc).removeprefix(f"{field}: ")) from None
    return so


def validate_request(
    request: DecodedRequest | inference_pb2.GenerateRequest,
    limits: ModelLimits,
    encode: Callable[[str], list[int]],
    in_flight: Container[str] = (),
) -> ValidatedRequest:
    """Check everything about a request; tokenize a text prompt with `encode`.

    `in_flight` holds the request ids now running (a duplicate is refused). An empty request_id
    stays empty here; the caller assigns one. Raises `RequestValidationError` on the first
    problem found. Pure apart from calling `encode`.
    """
    if isinstance(request, inference_pb2.GenerateRequest):
        request = DecodedRequest(request)  # already parsed: "both prompt kinds" is not visible
    if request.error is not None:
        raise request.error
    req = request.message
    assert req is not None, "DecodedRequest without message or error"
    _check_unknown_fields(req, "")
    if req.HasField("sampling"):
        _check_unknown_fields(req.sampling, "sampling")
    _check_request_id(req.request_id, in_flight)
    ids = _prompt_ids(req, request.prompt_fields, encode, limits)
    sampling = _sampling(req.sampling, len(ids), limits)
    return ValidatedRequest(
        request_id=req.request_id,
        prompt_token_ids=tuple(ids),
        sampling=sampling,
        stop=tuple(req.sampling.stop),
    )
