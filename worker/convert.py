"""Conversions between worker.proto messages and runtime types. Runs in every worker process.

`kvtransfer.TransferTicket` <-> `pdserve.v1.TransferTicket`::

    kvtransfer field           proto field
    transfer_id                transfer_id
    epoch                      epoch            (the decode worker's process epoch)
    request_id                 request_id
    num_tokens                 num_tokens
    dst_block_ids              block_ids
    receiver.worker_id         decode_worker_id
    receiver.host / .port      kv_endpoint      ("host:port" of the decode side's KV store)
    layout                     layout
    timeout_ms                 timeout_ms

Bad input raises ValueError naming the field (the service answers INVALID_ARGUMENT).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtransfer.types import PeerEndpoint, TransferTicket
from model_runtime.kv_cache import KVLayout
from model_runtime.request import RequestOutput
from model_runtime.sampling_params import SamplingParams, TopLogprobs
from model_runtime.structured import StructuredOutput
from proto.pdserve.v1 import inference_pb2, worker_pb2


def structured_from_proto(msg: inference_pb2.StructuredOutputs) -> StructuredOutput | None:
    """The constraint a `StructuredOutputs` message carries; None when none is set."""
    kind = msg.WhichOneof("constraint")
    if kind is None:
        return None
    value = list(msg.choice.choices) if kind == "choice" else getattr(msg, kind)
    return StructuredOutput.of(kind, value, lenient=msg.lenient)


def sampling_from_proto(s: worker_pb2.WorkerSampling, vocab_size: int) -> SamplingParams:
    """The engine's `SamplingParams` (validated); proto's unset top_p (0) means 1.0."""
    params = SamplingParams(
        min_tokens=s.min_tokens,
        logprobs=s.logprobs if s.HasField("logprobs") else None,
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p if s.top_p > 0 else 1.0,
        top_k=s.top_k,
        seed=s.seed if s.has_seed else None,
        stop_token_ids=tuple(s.stop_token_ids),
        ignore_eos=s.ignore_eos,
        structured=structured_from_proto(s.structured_outputs),
        speculative=not s.no_speculation,
    )
    params.validate(vocab_size)
    return params


def logprobs_to_proto(
    pairs: Sequence[tuple[float, TopLogprobs | None]],
) -> list[inference_pb2.TokenLogprob]:
    """(logprob, top alternatives) per token -> `TokenLogprob` messages."""
    return [
        inference_pb2.TokenLogprob(
            logprob=lp,
            top=[inference_pb2.TopLogprob(token_id=t, logprob=v) for t, v in top or ()],
        )
        for lp, top in pairs
    ]


def token_chunk(out: RequestOutput, logprobs: bool) -> worker_pb2.TokenChunk:
    """A step's output for one request as the `TokenChunk` that streams it: its new tokens,
    whether it finished and why, and (`logprobs`: the request asked for them) their logprobs."""
    chunk = worker_pb2.TokenChunk(
        token_ids=list(out.new_token_ids),
        finished=out.finished,
        finish_reason=out.finish_reason or "",
    )
    if logprobs:
        chunk.logprobs.extend(logprobs_to_proto(out.new_logprobs()))
    return chunk


def layout_to_proto(layout: KVLayout) -> worker_pb2.KVLayout:
    return worker_pb2.KVLayout(
        model_name=layout.model_name,
        dtype=layout.dtype,
        block_size=layout.block_size,
        num_layers=layout.num_layers,
        num_kv_heads=layout.num_kv_heads,
        head_dim=layout.head_dim,
        cache_dtype=layout.cache_dtype,
    )


def layout_from_proto(msg: worker_pb2.KVLayout) -> KVLayout:
    return KVLayout(
        model_name=msg.model_name,
        dtype=msg.dtype,
        block_size=msg.block_size,
        num_layers=msg.num_layers,
        num_kv_heads=msg.num_kv_heads,
        head_dim=msg.head_dim,
        cache_dtype=msg.cache_dtype or msg.dtype,  # a peer from before cache_dtype: as dtype
    )


def endpoint_text(endpoint: PeerEndpoint) -> str:
    return f"{endpoint.host}:{endpoint.port}"


def ticket_to_proto(ticket: TransferTicket) -> worker_pb2.TransferTicket:
    return worker_pb2.TransferTicket(
        transfer_id=ticket.transfer_id,
        epoch=ticket.epoch,
        block_ids=list(ticket.dst_block_ids),
        layout=layout_to_proto(ticket.layout),
        kv_endpoint=endpoint_text(ticket.receiver),
        decode_worker_id=ticket.receiver.worker_id,
        num_tokens=ticket.num_tokens,
        timeout_ms=ticket.timeout_ms,
        request_id=ticket.request_id,
    )


def ticket_from_proto(msg: worker_pb2.TransferTicket) -> TransferTicket:
    """A validated `TransferTicket`; ValueError naming the field when it cannot be one."""
    host, sep, port = msg.kv_endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ticket.kv_endpoint must be 'host:port', got {msg.kv_endpoint!r}")
    if not msg.HasField("layout"):
        raise ValueError("ticket.layout is missing")
    if not msg.decode_worker_id:
        raise ValueError("ticket.decode_worker_id is empty")
    ticket = TransferTicket(
        transfer_id=msg.transfer_id,
        epoch=msg.epoch,
        request_id=msg.request_id,
        num_tokens=msg.num_tokens,
        dst_block_ids=tuple(msg.block_ids),
        receiver=PeerEndpoint(msg.decode_worker_id, host, int(port)),
        layout=layout_from_proto(msg.layout),
        timeout_ms=msg.timeout_ms,
    )
    ticket.validate()
    return ticket
