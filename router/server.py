"""The public `pdserve.v1.Inference` gRPC service. Runs in the router process (grpc.aio).

A thin edge over `lifecycle.RequestLifecycle`, which runs every public request (this service's
and the HTTP front's alike): `Generate` passes the decoded request, a `send` that writes each
`GenerateResponse` to the stream and the client's deadline, and turns a `RouterError` into the
call's status. Status codes at this edge (the router's error table):

- INVALID_ARGUMENT: bad input, message names the field; never reaches a worker;
- RESOURCE_EXHAUSTED: admission queue full (answered at once) or no worker with KV room;
- UNAVAILABLE: no healthy worker, or a worker failed (retried elsewhere while nothing was sent);
- DEADLINE_EXCEEDED: the client's deadline (or `default_timeout_s`) passed;
- CANCELLED: the client went away (grpc cancels the handler; the lifecycle only cleans up);
- INTERNAL: a broken invariant, logged with its traceback.
"""

from __future__ import annotations

import grpc

from proto.pdserve.v1 import inference_pb2
from router.admission import Admission
from router.errors import RouterError
from router.lifecycle import RequestLifecycle
from router.request_trace import NEW_TRACE, TraceStart
from router.validation import (
    DEFAULT_MAX_TOKENS,
    DecodedRequest,
    decode_generate_request,
    decode_model_info_request,
)

SERVICE_NAME = "pdserve.v1.Inference"


class InferenceService:
    """Handlers of the `Inference` service; register with `server.add_generic_rpc_handlers`."""

    def __init__(self, lifecycle: RequestLifecycle) -> None:
        self.lifecycle = lifecycle

    def rpc_handlers(self) -> grpc.GenericRpcHandler:
        """Method handlers with never-failing deserializers (see `validation`): a request that
        does not parse, or is over the model's size limit, gets INVALID_ARGUMENT naming why."""
        max_bytes = self.lifecycle.limits.max_request_bytes
        return grpc.method_handlers_generic_handler(
            SERVICE_NAME,
            {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self.Generate,
                    request_deserializer=lambda data: decode_generate_request(data, max_bytes),
                    response_serializer=inference_pb2.GenerateResponse.SerializeToString,
                ),
                "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                    self.GetModelInfo,
                    request_deserializer=decode_model_info_request,
                    response_serializer=inference_pb2.ModelInfo.SerializeToString,
                ),
            },
        )

    @property
    def admission(self) -> Admission:
        """The admission queue (read its counters in tests and metrics)."""
        return self.lifecycle.admission

    async def GetModelInfo(
        self,
        request: inference_pb2.GetModelInfoRequest | None,
        context: grpc.aio.ServicerContext,
    ) -> inference_pb2.ModelInfo:
        """The served model's name and limits and the router's mode."""
        if request is None:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "request: malformed GetModelInfoRequest"
            )
        config, limits = self.lifecycle.config, self.lifecycle.limits
        return inference_pb2.ModelInfo(
            model=config.served_model_name,
            context_length=limits.context_length,
            vocab_size=limits.vocab_size,
            mode=config.mode,
            max_tokens_default=DEFAULT_MAX_TOKENS,
        )

    async def Generate(self, decoded: DecodedRequest, context: grpc.aio.ServicerContext) -> None:
        """Stream one completion; see the module docstring for the statuses."""

        async def send(resp: inference_pb2.GenerateResponse) -> None:
            await context.write(resp)

        trace = (  # a client's W3C trace context continues here (read only with tracing on)
            TraceStart(headers=context.invocation_metadata())
            if self.lifecycle.tracer.enabled
            else NEW_TRACE
        )
        try:
            await self.lifecycle.run(decoded, send, context.time_remaining(), trace)
        except RouterError as err:
            context.set_code(err.code)  # no exception raised here: cheaper under a burst
            context.set_details(err.public)

    async def wait_cleanup(self, timeout_s: float) -> None:
        """Wait (bounded) for pending cleanup aborts; used at shutdown and in tests."""
        await self.lifecycle.wait_cleanup(timeout_s)
