"""A table of invalid `GenerateRequest`s, as wire bytes, with the field each must be blamed on.

Runs in the test process. Shared by the validation unit tests (decoded and validated directly)
and the router integration test (sent over gRPC, each must get INVALID_ARGUMENT). Wire bytes,
not messages, because some bad inputs cannot be built with the Python protobuf API: invalid
UTF-8 in a `string`, both oneof members at once, unknown field numbers.

Limits assumed: the tiny random model (vocab 1024, context 1024). Each entry is a distinct class
of bad input; the unit tests run each as its own named test.
"""

from __future__ import annotations

from dataclasses import dataclass

from proto.pdserve.v1 import inference_pb2 as ipb

VOCAB = 1024
CONTEXT = 1024


@dataclass(frozen=True)
class BadRequest:
    name: str
    payload: bytes
    field: str  # must appear in the error message


def _req(**kw: object) -> bytes:
    return ipb.GenerateRequest(**kw).SerializeToString()  # type: ignore[arg-type]


def _sp(**kw: object) -> ipb.SamplingParams:
    return ipb.SamplingParams(**kw)  # type: ignore[arg-type]


def _len_field(number: int, body: bytes) -> bytes:
    assert len(body) < 128, "one-byte lengths only"
    return bytes([number << 3 | 2, len(body)]) + body


UNKNOWN_FIELD_99 = b"\x98\x06\x01"  # field 99, varint 1
TEXT = {"text": "hello world"}

BAD_REQUESTS: list[BadRequest] = [
    BadRequest("no prompt", _req(), "prompt"),
    BadRequest(
        "both prompt kinds", _req(text="hi") + _req(token_ids=ipb.TokenIds(ids=[5])), "prompt"
    ),
    BadRequest("empty text", _req(text=""), "text"),  # a oneof member has presence
    BadRequest("empty token ids", _req(token_ids=ipb.TokenIds()), "token_ids.ids"),
    BadRequest("negative token id", _req(token_ids=ipb.TokenIds(ids=[5, -1])), "token_ids.ids[1]"),
    BadRequest("token id >= vocab", _req(token_ids=ipb.TokenIds(ids=[VOCAB])), "token_ids.ids[0]"),
    BadRequest(
        "prompt fills context", _req(token_ids=ipb.TokenIds(ids=[5] * CONTEXT)), "token_ids"
    ),
    BadRequest("max_tokens 0", _req(**TEXT, sampling=_sp(max_tokens=0)), "sampling.max_tokens"),
    BadRequest("max_tokens < 0", _req(**TEXT, sampling=_sp(max_tokens=-3)), "sampling.max_tokens"),
    BadRequest(
        "prompt + max_tokens > context",
        _req(token_ids=ipb.TokenIds(ids=[5] * 10), sampling=_sp(max_tokens=CONTEXT - 9)),
        "sampling.max_tokens",
    ),
    BadRequest(
        "temperature < 0", _req(**TEXT, sampling=_sp(temperature=-0.5)), "sampling.temperature"
    ),
    BadRequest(
        "temperature nan",
        _req(**TEXT, sampling=_sp(temperature=float("nan"))),
        "sampling.temperature",
    ),
    BadRequest(
        "temperature inf",
        _req(**TEXT, sampling=_sp(temperature=float("inf"))),
        "sampling.temperature",
    ),
    BadRequest("top_p 0", _req(**TEXT, sampling=_sp(top_p=0.0)), "sampling.top_p"),
    BadRequest("top_p > 1", _req(**TEXT, sampling=_sp(top_p=1.5)), "sampling.top_p"),
    BadRequest("top_k < 0", _req(**TEXT, sampling=_sp(top_k=-1)), "sampling.top_k"),
    BadRequest("logprobs < 0", _req(**TEXT, sampling=_sp(logprobs=-1)), "sampling.logprobs"),
    BadRequest("logprobs > 20", _req(**TEXT, sampling=_sp(logprobs=21)), "sampling.logprobs"),
    BadRequest(
        "min_tokens > max_tokens",
        _req(**TEXT, sampling=_sp(max_tokens=4, min_tokens=5)),
        "sampling.min_tokens",
    ),
    BadRequest("min_tokens < 0", _req(**TEXT, sampling=_sp(min_tokens=-1)), "sampling.min_tokens"),
    BadRequest("seed >= 2^63", _req(**TEXT, sampling=_sp(seed=2**64 - 1)), "sampling.seed"),
    BadRequest(
        "empty stop string", _req(**TEXT, sampling=_sp(stop=["ok", ""])), "sampling.stop[1]"
    ),
    BadRequest(
        "stop string too long", _req(**TEXT, sampling=_sp(stop=["x" * 257])), "sampling.stop[0]"
    ),
    BadRequest(
        "too many stop strings", _req(**TEXT, sampling=_sp(stop=["a"] * 17)), "sampling.stop"
    ),
    BadRequest(
        "stop string invalid UTF-8",
        _req(**TEXT) + _len_field(4, _len_field(7, b"ok") + _len_field(7, b"\xffb")),
        "sampling.stop[1]",
    ),
    BadRequest(
        "stop token id >= vocab",
        _req(**TEXT, sampling=_sp(stop_token_ids=[VOCAB + 5])),
        "sampling.stop_token_ids[0]",
    ),
    BadRequest(
        "stop token id < 0",
        _req(**TEXT, sampling=_sp(stop_token_ids=[1, -2])),
        "sampling.stop_token_ids[1]",
    ),
    BadRequest("text invalid UTF-8", _len_field(2, b"h\xc3("), "text"),
    BadRequest("request_id invalid UTF-8", _len_field(1, b"\xfe") + _req(**TEXT), "request_id"),
    BadRequest("request_id too long", _req(**TEXT, request_id="r" * 129), "request_id"),
    BadRequest("request_id not printable", _req(**TEXT, request_id="a\nb"), "request_id"),
    BadRequest("unknown top-level field", _req(**TEXT) + UNKNOWN_FIELD_99, "request"),
    BadRequest(
        "unknown sampling field",
        _req(**TEXT) + _len_field(4, _sp(max_tokens=4).SerializeToString() + UNKNOWN_FIELD_99),
        "sampling",
    ),
    BadRequest("malformed protobuf", b"\x12\x05ab", "request"),
    # a known field with the wrong wire type is named (protobuf keeps it as an unknown field)
    BadRequest("token_ids as a varint", bytes([3 << 3 | 0, 5]), "token_ids"),
    BadRequest("text as a varint", bytes([2 << 3 | 0, 5]), "text"),
    BadRequest("sampling as a fixed32", bytes([4 << 3 | 5, 0, 0, 0, 0]) + _req(**TEXT), "sampling"),
    BadRequest(
        "max_tokens as bytes",
        _req(**TEXT) + _len_field(4, _len_field(1, b"12")),
        "sampling.max_tokens",
    ),
    BadRequest(
        "too many stop token ids",
        _req(**TEXT, sampling=_sp(stop_token_ids=[5] * 65)),
        "sampling.stop_token_ids",
    ),
    BadRequest(
        "temperature -inf",
        _req(**TEXT, sampling=_sp(temperature=float("-inf"))),
        "sampling.temperature",
    ),
    BadRequest("top_p nan", _req(**TEXT, sampling=_sp(top_p=float("nan"))), "sampling.top_p"),
    BadRequest("top_p < 0", _req(**TEXT, sampling=_sp(top_p=-0.5)), "sampling.top_p"),
    BadRequest("seed = 2^63", _req(**TEXT, sampling=_sp(seed=2**63)), "sampling.seed"),
    BadRequest("text longer than the context", _req(text="x " * 3000), "text"),
    BadRequest(
        "max_tokens int32 max",
        _req(**TEXT, sampling=_sp(max_tokens=2**31 - 1)),
        "sampling.max_tokens",
    ),
    BadRequest(
        "max_tokens int32 min",
        _req(**TEXT, sampling=_sp(max_tokens=-(2**31))),
        "sampling.max_tokens",
    ),
    BadRequest(
        "token id int32 min", _req(token_ids=ipb.TokenIds(ids=[-(2**31)])), "token_ids.ids[0]"
    ),
    BadRequest("truncated varint in sampling", _req(**TEXT) + _len_field(4, b"\x08"), "request"),
    BadRequest("garbage sampling bytes", _req(**TEXT) + _len_field(4, b"\xff\xff"), "request"),
    BadRequest("group wire type", _req(**TEXT) + b"\x0b", "request"),
    BadRequest("length beyond the payload", b"\x12\x7f" + b"a" * 3, "request"),
    BadRequest(
        "unknown field in token_ids", _len_field(3, b"\x08\x05" + UNKNOWN_FIELD_99), "token_ids"
    ),
    BadRequest("request_id with DEL", _req(**TEXT, request_id="a\x7fb"), "request_id"),
    BadRequest(
        "lenient without a constraint",
        _req(**TEXT, sampling=_sp(structured_outputs=ipb.StructuredOutputs(lenient=True))),
        "sampling.structured_outputs.lenient",
    ),
    BadRequest(
        "lenient regex",
        _req(
            **TEXT, sampling=_sp(structured_outputs=ipb.StructuredOutputs(regex="a+", lenient=True))
        ),
        "sampling.structured_outputs.lenient",
    ),
    BadRequest(
        "json_object false",
        _req(**TEXT, sampling=_sp(structured_outputs=ipb.StructuredOutputs(json_object=False))),
        "sampling.structured_outputs.json_object",
    ),
]
