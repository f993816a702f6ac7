"""A role made of parts: one worker role that serves the RPCs of several roles on one engine.

Runs in the engine thread of a worker process. `compose(name, *parts)` builds the role class;
the composition root (`worker_main.ROLES`) composes the "decode" role from
`decode_worker.decode.RemoteDecodeRole` (Reserve + Decode: KV prefilled on a prefill worker)
and `colocated_worker.colocated.ColocatedRole` (Generate: the prompt prefilled here, chunked
inside this worker's decode batches), so a decode worker also serves the requests the router
prefills on it (`router.hybrid`).

It is dispatch, not a third implementation. Ownership: a request id belongs to at most one
part at a time (an RPC for an id live in another part is refused with ALREADY_EXISTS); each
RPC goes to the part whose table lists it, each output, hand-off outcome and abort to the
part that holds its request id; every KV block stays the engine scheduler's, so
`LLMEngine.check_integrity` and the role switch's drain see all of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, TypeVar, cast

from model_runtime.engine import LayerCallback
from model_runtime.request import RequestOutput
from model_runtime.scheduler_types import SchedulerOutput
from worker.kv_handoff import HandoffOutcome
from worker.roles import RoleContext, RoleHandler, Rpc
from worker.sinks import Sink, WorkerError

R = TypeVar("R", bound=RoleHandler)
Out = TypeVar("Out", RequestOutput, HandoffOutcome)


class CompositeRole(RoleHandler):
    """The parts of one role on one engine (module docstring). Built by `compose`."""

    parts: ClassVar[tuple[type[RoleHandler], ...]] = ()

    def __init__(self, ctx: RoleContext) -> None:
        super().__init__(ctx)
        self._parts = [part(ctx) for part in self.parts]

    def part(self, kind: type[R]) -> R:
        """This role's part of class `kind`."""
        found = [p for p in self._parts if isinstance(p, kind)]
        assert len(found) == 1, (kind, self._parts)
        return found[0]

    def _call(
        self, index: int, rpc: Rpc[Any, Any, Any], request: Any, sink: Sink, timeout_s: float | None
    ) -> None:
        """Run `rpc` on part `index`; ALREADY_EXISTS when another part holds the request id."""
        request_id = rpc.request_id(request)
        if any(p.holds(request_id) for i, p in enumerate(self._parts) if i != index):
            raise self.duplicate(request_id)
        rpc.call(self._parts[index], request, sink, timeout_s)

    def _owner(self, request_id: str) -> RoleHandler:
        owner = next((p for p in self._parts if p.holds(request_id)), None)
        assert owner is not None, f"request {request_id!r} is held by no part of {self.name}"
        return owner

    def before_forward(self, scheduled: SchedulerOutput) -> LayerCallback | None:
        callbacks = [cb for cb in (p.before_forward(scheduled) for p in self._parts) if cb]
        if len(callbacks) <= 1:
            return callbacks[0] if callbacks else None

        def on_layer_done(layer: int) -> None:
            for cb in callbacks:
                cb(layer)

        return on_layer_done

    def _by_owner(self, items: Sequence[Out]) -> list[tuple[RoleHandler, list[Out]]]:
        """`items` (each naming a request id) grouped by the part that holds the request, in
        part order."""
        mine: dict[int, list[Out]] = {}
        for item in items:
            mine.setdefault(id(self._owner(item.request_id)), []).append(item)
        return [(p, mine[id(p)]) for p in self._parts if id(p) in mine]

    def on_outputs(self, outputs: Sequence[RequestOutput], started: float, ended: float) -> None:
        for part, mine in self._by_owner(outputs):
            part.on_outputs(mine, started, ended)

    def on_handoff(self, outcomes: Sequence[HandoffOutcome]) -> None:
        for part, mine in self._by_owner(outcomes):
            part.on_handoff(mine)

    def expire(self, now: float) -> None:
        for part in self._parts:
            part.expire(now)

    def abort(self, request_id: str, sink: Sink | None, error: WorkerError) -> bool:
        return any(part.abort(request_id, sink, error) for part in self._parts)

    def holds(self, request_id: str) -> bool:
        return any(part.holds(request_id) for part in self._parts)

    def request_ids(self) -> list[str]:
        return [rid for part in self._parts for rid in part.request_ids()]

    def num_active(self) -> int:
        return sum(part.num_active() for part in self._parts)


def compose(name: str, *parts: type[RoleHandler]) -> type[CompositeRole]:
    """The role `name` made of `parts` (module docstring). Each part's RPCs keep their types
    and their draining and between-layers rules; no RPC may be listed by two parts."""
    rpcs: list[Rpc[Any, Any, Any]] = []
    for index, part in enumerate(parts):
        for rpc in part.rpcs:

            def entry(
                role: CompositeRole,
                request: Any,
                sink: Sink,
                timeout_s: float | None,
                index: int = index,
                rpc: Rpc[Any, Any, Any] = rpc,
            ) -> None:
                role._call(index, rpc, request, sink, timeout_s)

            rpcs.append(dataclasses.replace(rpc, entry=entry))
    methods = [rpc.method for rpc in rpcs]
    if len(set(methods)) != len(methods):
        raise ValueError(f"role {name!r}: an RPC listed by two parts ({methods})")
    namespace = {
        "name": name,
        "parts": parts,
        "rpcs": tuple(rpcs),
        "__doc__": f"The {name!r} role: {', '.join(p.__name__ for p in parts)} on one engine.",
    }
    return cast(type[CompositeRole], type(f"Composite_{name}", (CompositeRole,), namespace))
