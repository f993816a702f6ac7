"""Hypothesis strategies for fuzzing the public API, and the statuses a fuzzed call may end with.

Runs in the test process. `generate_requests()` draws `GenerateRequest`s with every field
random (any int32 / uint64, float32 including NaN and infinities, any text, either prompt kind
or none) mixed with plausible values, so both the validation paths and the serving paths get
exercised; `wire_payloads()` adds raw random bytes and valid messages with bytes flipped or cut.

Documented outcomes of a fuzzed `Generate` (inference.proto): OK, INVALID_ARGUMENT (bad input),
RESOURCE_EXHAUSTED (no KV room for a valid but large request). Anything else — INTERNAL,
UNKNOWN, UNAVAILABLE on a healthy cluster — is a bug.
"""

from __future__ import annotations

import grpc
from hypothesis import strategies as st

from proto.pdserve.v1 import inference_pb2 as ipb

GENERATE_OK = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


def _small_or_any(small: st.SearchStrategy[int]) -> st.SearchStrategy[int]:
    return st.one_of(small, INT32)


@st.composite
def sampling_params(draw: st.DrawFn) -> ipb.SamplingParams:
    sp = ipb.SamplingParams()
    if draw(st.booleans()):
        sp.max_tokens = draw(_small_or_any(st.sampled_from([1, 2, 4, 8, 16])))
    if draw(st.booleans()):
        sp.temperature = draw(st.one_of(st.sampled_from([0.0, 0.5, 1.0]), FLOAT32))
    if draw(st.booleans()):
        sp.top_p = draw(st.one_of(st.sampled_from([1.0, 0.9]), FLOAT32))
    if draw(st.booleans()):
        sp.top_k = draw(_small_or_any(st.sampled_from([0, 1, 50])))
    if draw(st.booleans()):
        sp.seed = draw(st.integers(0, 2**64 - 1))
    sp.stop_token_ids.extend(draw(st.lists(_small_or_any(st.integers(0, 1023)), max_size=4)))
    sp.stop.extend(draw(st.lists(st.text(max_size=8), max_size=3)))
    sp.ignore_eos = draw(st.booleans())
    return sp


@st.composite
def generate_requests(draw: st.DrawFn) -> ipb.GenerateRequest:
    """A `GenerateRequest` with random fields (see the module docstring)."""
    req = ipb.GenerateRequest(request_id=draw(st.one_of(st.just(""), st.text(max_size=140))))
    kind = draw(st.sampled_from(["text", "ids", "any_ids", "none"]))
    if kind == "text":
        req.text = draw(st.text(max_size=200))
    elif kind == "ids":
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, 1023), min_size=1, max_size=40)))
    elif kind == "any_ids":
        req.token_ids.ids.extend(draw(st.lists(INT32, max_size=40)))
    if draw(st.booleans()):
        req.sampling.CopyFrom(draw(sampling_params()))
    return req


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A valid request's wire bytes with a few bytes overwritten, and possibly cut short."""
    data = bytearray(draw(generate_requests()).SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    if data and draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]
    return bytes(data)


def wire_payloads() -> st.SearchStrategy[bytes]:
    """Raw bytes, valid-then-damaged messages, and valid messages."""
    return st.one_of(
        st.binary(max_size=300),
        mutated(),
        generate_requests().map(lambda r: r.SerializeToString()),
    )
