"""The router's requests in the worker API's form. Runs in the router process; torch-free.

`worker_sampling(params)`: a validated request's `SamplingParams` as `WorkerSampling` (stop
strings stay in the router, which matches them on the detokenized stream). The router validated
`params` at its edge (`router.validation`); the worker checks the message again at its own.
"""

from __future__ import annotations

import json

from model_runtime.sampling_params import SamplingParams
from model_runtime.structured import StructuredOutput
from proto.pdserve.v1 import inference_pb2, worker_pb2


def structured_to_proto(so: StructuredOutput) -> inference_pb2.StructuredOutputs:
    """`so` as the wire's `StructuredOutputs` (what `worker.convert.structured_from_proto`
    reads back)."""
    if so.kind == "json_object":
        return inference_pb2.StructuredOutputs(json_object=True)
    if so.kind == "choice":
        choices = inference_pb2.ChoiceList(choices=json.loads(so.spec))
        return inference_pb2.StructuredOutputs(choice=choices)
    msg = inference_pb2.StructuredOutputs(lenient=not so.strict)
    setattr(msg, so.kind, so.spec)
    return msg


def worker_sampling(params: SamplingParams) -> worker_pb2.WorkerSampling:
    """`params` as the worker API's `WorkerSampling` (without `num_sampled`: per leg)."""
    out = worker_pb2.WorkerSampling(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        has_seed=params.seed is not None,
        seed=params.seed or 0,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        min_tokens=params.min_tokens,
        logprobs=params.logprobs,
        no_speculation=not params.speculative,
    )
    if params.structured is not None:
        out.structured_outputs.CopyFrom(structured_to_proto(params.structured))
    return out
