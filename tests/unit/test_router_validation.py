"""Unit tests of `router.validation` (pure: no gRPC, no workers)."""

from __future__ import annotations

import math

import pytest

from proto.pdserve.v1 import inference_pb2 as ipb
from router.validation import (
    DEFAULT_MAX_TOKENS,
    ModelLimits,
    RequestValidationError,
    decode_generate_request,
    validate_request,
)
from router.wire import worker_sampling
from tests.fakes.bad_requests import BAD_REQUESTS, CONTEXT, VOCAB, BadRequest

LIMITS = ModelLimits(vocab_size=VOCAB, context_length=CONTEXT)


def fake_encode(text: str) -> list[int]:
    """BOS + one id per character (the real tokenizer is not needed here)."""
    return [0, *(ord(c) % VOCAB for c in text)]


def check(payload: bytes, in_flight: tuple[str, ...] = ()) -> object:
    return validate_request(decode_generate_request(payload), LIMITS, fake_encode, in_flight)


def test_the_bad_request_table_is_large_and_distinct() -> None:
    assert len(BAD_REQUESTS) >= 15
    assert len({b.payload for b in BAD_REQUESTS}) == len(BAD_REQUESTS)


@pytest.mark.parametrize("bad", BAD_REQUESTS, ids=lambda b: b.name)
def test_bad_request_names_its_field(bad: BadRequest) -> None:
    with pytest.raises(RequestValidationError) as err:
        check(bad.payload)
    assert str(err.value).startswith(f"{bad.field}:"), str(err.value)
    assert err.value.field == bad.field
    assert isinstance(err.value, ValueError)


def test_defaults_apply_when_fields_are_absent() -> None:
    v = validate_request(ipb.GenerateRequest(text="hi"), LIMITS, fake_encode)
    assert v.prompt_token_ids == (0, ord("h"), ord("i"))
    s = v.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (
        DEFAULT_MAX_TOKENS,
        0.0,
        1.0,
        0,
        None,
    )
    assert v.stop == () and v.request_id == ""


def test_default_max_tokens_is_clamped_to_the_room_left() -> None:
    ids = ipb.TokenIds(ids=[7] * (CONTEXT - 3))
    v = validate_request(ipb.GenerateRequest(token_ids=ids), LIMITS, fake_encode)
    assert v.sampling.max_tokens == 3


def test_explicit_values_pass_through_to_worker_sampling() -> None:
    req = ipb.GenerateRequest(
        request_id="req-1",
        token_ids=ipb.TokenIds(ids=[5, 6, VOCAB - 1]),
        sampling=ipb.SamplingParams(
            max_tokens=CONTEXT - 3,
            temperature=0.7,
            top_p=0.9,
            top_k=40,
            seed=2**63 - 1,
            stop_token_ids=[0, VOCAB - 1],
            stop=["\n\n", "ü"],
            ignore_eos=True,
        ),
    )
    v = validate_request(req, LIMITS, fake_encode)
    assert v.request_id == "req-1" and v.prompt_token_ids == (5, 6, VOCAB - 1)
    assert v.stop == ("\n\n", "ü")
    ws = worker_sampling(v.sampling)
    assert ws.max_tokens == CONTEXT - 3 and math.isclose(ws.temperature, 0.7, rel_tol=1e-6)
    assert math.isclose(ws.top_p, 0.9, rel_tol=1e-6) and ws.top_k == 40
    assert ws.has_seed and ws.seed == 2**63 - 1
    assert list(ws.stop_token_ids) == [0, VOCAB - 1] and ws.ignore_eos


def test_seed_zero_is_a_seed() -> None:
    req = ipb.GenerateRequest(text="x", sampling=ipb.SamplingParams(seed=0))
    ws = worker_sampling(validate_request(req, LIMITS, fake_encode).sampling)
    assert ws.has_seed and ws.seed == 0


def test_duplicate_in_flight_request_id_is_refused() -> None:
    payload = ipb.GenerateRequest(request_id="dup", text="x").SerializeToString()
    with pytest.raises(RequestValidationError, match=r"^request_id: 'dup' is already in flight"):
        check(payload, in_flight=("dup",))
    assert check(payload, in_flight=("other",)) is not None


def test_text_whose_tokens_overflow_the_context_blames_text() -> None:
    payload = ipb.GenerateRequest(text="a" * CONTEXT).SerializeToString()
    with pytest.raises(RequestValidationError, match=r"^text: prompt is 1025 tokens"):
        check(payload)


def test_decoder_never_raises_and_keeps_the_culprit() -> None:
    decoded = decode_generate_request(b"\x0a\x01\xff\x12\x02hi")  # request_id = b"\xff"
    assert decoded.message is None
    assert decoded.error is not None and decoded.error.field == "request_id"
    ok = decode_generate_request(ipb.GenerateRequest(text="hi").SerializeToString())
    assert ok.error is None and ok.message is not None and ok.message.text == "hi"
    assert ok.prompt_fields == frozenset({2})


@pytest.mark.parametrize("temperature", [1e-45, 1e-38, 1e-9])
def test_tiny_temperature_is_greedy(temperature: float) -> None:
    """Below `GREEDY_BELOW` the router sends temperature 0: the workers decode greedily
    (1e-45 used to reach the sampler and come back as token 0 at every position)."""
    msg = ipb.GenerateRequest(text="hi", sampling=ipb.SamplingParams(temperature=temperature))
    v = validate_request(msg, LIMITS, fake_encode)
    assert v.sampling.temperature == 0.0 and v.sampling.greedy
    assert worker_sampling(v.sampling).temperature == 0.0


def test_text_beyond_the_context_is_refused_by_size_before_tokenizing() -> None:
    """A text that cannot fit (more characters than `max_prompt_chars`) is refused naming the
    limit without tokenizing it (3.9 MB of text used to take 2.5 s on the router's loop)."""
    limits = ModelLimits.for_model(VOCAB, CONTEXT, max_token_chars=4)
    assert limits.max_prompt_chars == 2 * 4 * (CONTEXT - 1)

    def must_not_encode(text: str) -> list[int]:
        raise AssertionError("tokenized a text that cannot fit")

    too_long = ipb.GenerateRequest(text="x" * (limits.max_prompt_chars + 1))
    with pytest.raises(RequestValidationError) as err:
        validate_request(too_long, limits, must_not_encode)
    assert err.value.field == "text"
    assert f"at most {limits.max_prompt_chars} characters" in str(err.value), str(err.value)
    ok = ipb.GenerateRequest(text="x" * limits.max_prompt_chars)
    with pytest.raises(RequestValidationError):  # within the bound: tokenized, then too long
        validate_request(ok, limits, lambda t: [5] * len(t))


def test_oversized_request_is_refused_by_its_size() -> None:
    limits = ModelLimits.for_model(VOCAB, CONTEXT, max_token_chars=4)
    big = ipb.GenerateRequest(text="x" * limits.max_request_bytes).SerializeToString()
    decoded = decode_generate_request(big, limits.max_request_bytes)
    assert decoded.message is None and decoded.error is not None
    assert decoded.error.field == "request"
    assert f"limit is {limits.max_request_bytes} bytes" in str(decoded.error), str(decoded.error)
    small = ipb.GenerateRequest(text="hi").SerializeToString()
    assert decode_generate_request(small, limits.max_request_bytes).error is None


def test_speculative_opt_out_reaches_the_worker() -> None:
    """Unset or true: speculate as the worker is configured; false: never for this request."""
    from worker.convert import sampling_from_proto

    for flag, want in ((None, True), (True, True), (False, False)):
        sp = ipb.SamplingParams() if flag is None else ipb.SamplingParams(speculative=flag)
        v = validate_request(ipb.GenerateRequest(text="x", sampling=sp), LIMITS, fake_encode)
        assert v.sampling.speculative is want
        ws = worker_sampling(v.sampling)
        assert ws.no_speculation is not want
        assert sampling_from_proto(ws, VOCAB).speculative is want
