"""Hybrid decode role: a decode worker that also prefills locally (conditional disaggregation).

Runs in the engine thread of a decode worker. It is the `"decode"` role of every worker
(`worker_main.ROLES`): it serves the disaggregated decode leg — `Reserve` + `Decode`
(`decode.DecodeRole`) — and `Generate` (`colocated.ColocatedRole`: the prompt is prefilled
here, chunked, inside this worker's decode batches, exactly as on a colocated worker). Which
path a request takes is the router's choice (`router.hybrid`); a cluster whose router never
sends `Generate` to decode workers (`[router.hybrid]` off, the default) sees a plain decode
worker.

It is a composition, not a third implementation: it owns one `DecodeRole` and one
`ColocatedRole` on the same engine and passes each RPC, output and event to the sub-role that
owns the request. Ownership: a request id belongs to at most one of them at a time (an id live
in one is refused in the other with ALREADY_EXISTS); every KV block is still the engine
scheduler's, so `LLMEngine.check_integrity` and the role switch's drain see all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from decode_worker.colocated import ColocatedRole
from decode_worker.decode import DecodeRole
from kvtransfer.types import TransferResult
from model_runtime.engine import LayerCallback
from model_runtime.request import RequestOutput
from model_runtime.scheduler import SchedulerOutput
from proto.pdserve.v1 import worker_pb2
from worker.roles import RoleContext, RoleHandler
from worker.sinks import Sink, StreamSink, UnarySink, WorkerError


class HybridDecodeRole(RoleHandler):
    """`Reserve` + `Decode` (remote prefill) and `Generate` (local prefill) on one engine."""

    name = "decode"

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self.remote = DecodeRole(ctx)  # KV prefilled elsewhere, received here
        self.local = ColocatedRole(ctx)  # prefilled here

    # ---- RPCs: the one place they are dispatched to a sub-role ---------------------------------

    def _call(
        self,
        part: RoleHandler,
        other: RoleHandler,
        method: str,
        request_id: str,
        request: object,
        sink: Sink,
        timeout_s: float | None,
    ) -> None:
        """Run `method` on `part`; ALREADY_EXISTS when `other` holds the request id."""
        if request_id in other.request_ids():
            raise self.duplicate(request_id)
        part.rpc_table[method].call(part, request, sink, timeout_s)

    def reserve(
        self, req: worker_pb2.ReserveRequest, sink: UnarySink, timeout_s: float | None
    ) -> None:
        self._call(self.remote, self.local, "Reserve", req.request_id, req, sink, timeout_s)

    def decode(
        self, req: worker_pb2.DecodeRequest, sink: StreamSink, timeout_s: float | None
    ) -> None:
        self._call(self.remote, self.local, "Decode", req.request_id, req, sink, timeout_s)

    def generate(
        self, req: worker_pb2.WorkerGenerateRequest, sink: StreamSink, timeout_s: float | None
    ) -> None:
        self._call(self.local, self.remote, "Generate", req.request_id, req, sink, timeout_s)

    # The sub-roles' RPCs (types, draining and between-layers rules unchanged), entered here.
    rpcs = (
        dataclasses.replace(DecodeRole.rpc_table["Reserve"], entry=reserve),
        dataclasses.replace(DecodeRole.rpc_table["Decode"], entry=decode),
        dataclasses.replace(ColocatedRole.rpc_table["Generate"], entry=generate),
    )

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        callbacks = [
            cb for cb in (p.before_forward(scheduled) for p in (self.remote, self.local)) if cb
        ]
        if len(callbacks) <= 1:
            return callbacks[0] if callbacks else None

        def on_layer_done(layer: int) -> None:
            for cb in callbacks:
                cb(layer)

        return on_layer_done

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        local_ids = set(self.local.request_ids())
        local = [o for o in outputs if o.request_id in local_ids]
        remote = [o for o in outputs if o.request_id not in local_ids]
        if remote:
            self.remote.on_outputs(remote, started, ended)
        if local:
            self.local.on_outputs(local, started, ended)

    def on_transfer_results(self, results: Sequence[TransferResult]) -> None:
        self.remote.on_transfer_results(results)  # local prefills start no transfer

    def expire(self, now: float) -> None:
        self.remote.expire(now)
        self.local.expire(now)

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        return self.remote.abort(request_id, sink, error) or self.local.abort(
            request_id, sink, error
        )

    def request_ids(self) -> list[str]:
        return [*self.remote.request_ids(), *self.local.request_ids()]

    def num_active(self) -> int:
        return self.remote.num_active() + self.local.num_active()

    def transfers_in_flight(self) -> bool:
        return self.remote.transfers_in_flight() or self.local.transfers_in_flight()

    def num_pending(self) -> int:
        return self.remote.num_pending() + self.local.num_pending()

    def num_receiving(self) -> int:
        return self.remote.num_receiving()
