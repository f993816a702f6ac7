"""The router's requests in the worker API's form. Runs in the router process; torch-free.

`worker_sampling(params)`: a validated request's `SamplingParams` as `WorkerSampling` (stop
strings stay in the router, which matches them on the detokenized stream). The router validated
`params` at its edge (`router.validation`); the worker checks the message again at its own.
"""

from __future__ import annotations

from model_runtime.sampling_params import SamplingParams
from proto.pdserve.v1 import worker_pb2


def worker_sampling(params: SamplingParams) -> worker_pb2.WorkerSampling:
    """`params` as the worker API's `WorkerSampling` (without `num_sampled`: per leg)."""
    return worker_pb2.WorkerSampling(
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
    )
