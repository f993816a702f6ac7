"""A router in front of fake workers, all on the caller's event loop (tests and benchmarks).

Runs in the test process. `fake_cluster(...)` starts the fake workers, then the router, and
yields a `FakeCluster` with a client stub; on exit it stops the router, then the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from router.app import RouterHandle, start_router
from router.config import RouterConfig
from tests.fakes.fake_worker import FakeWorker, FakeWorkerConfig
from tests.fakes.kv_events import FakeKVWorker


async def wait_until(pred: Callable[[], bool], timeout_s: float = 3.0, what: str = "") -> None:
    """Poll `pred` every 10 ms until true; AssertionError naming `what` after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what or pred}")
        await asyncio.sleep(0.01)


@dataclass
class FakeCluster:
    """Router + fake workers + a client channel to the router."""

    router: RouterHandle
    prefill: list[FakeWorker]
    decode: list[FakeWorker]
    colocated: list[FakeWorker]
    channel: grpc.aio.Channel
    stub: inference_pb2_grpc.InferenceStub = field(init=False)
    health: health_pb2_grpc.HealthStub = field(init=False)

    def __post_init__(self) -> None:
        self.stub = inference_pb2_grpc.InferenceStub(self.channel)  # type: ignore[no-untyped-call]
        self.health = health_pb2_grpc.HealthStub(self.channel)

    @property
    def workers(self) -> list[FakeWorker]:
        return [*self.prefill, *self.decode, *self.colocated]

    async def generate(
        self, request: inference_pb2.GenerateRequest, timeout: float | None = 10.0
    ) -> list[inference_pb2.GenerateResponse]:
        """Every response of one Generate call (raises grpc.aio.AioRpcError on failure)."""
        return [r async for r in self.stub.Generate(request, timeout=timeout)]

    async def health_status(self, service: str = "") -> int:
        resp = await self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
        return int(resp.status)

    async def assert_no_leaks(
        self, timeout_s: float = 3.0, exclude: tuple[FakeWorker, ...] = ()
    ) -> None:
        """Every worker's free blocks return to its total (aborts are asynchronous).

        `exclude` skips workers that were killed: a dead process holds nothing.
        """
        live = [w for w in self.workers if all(w is not x for x in exclude)]
        await wait_until(
            lambda: all(w.free_blocks == w.config.total_blocks for w in live),
            timeout_s,
            "every worker's free blocks to return: "
            + ", ".join(f"{w.address}: held={sorted(w.held)}" for w in live),
        )


@contextlib.asynccontextmanager
async def fake_cluster(
    model_dir: Path,
    mode: str = "disagg",
    n_prefill: int = 1,
    n_decode: int = 1,
    n_colocated: int = 1,
    worker: FakeWorkerConfig | None = None,
    kv_blocks: int = 0,
    **router_kw: Any,
) -> AsyncIterator[FakeCluster]:
    """Start fake workers (copies of `worker`, role set per list) and a router over them.

    `kv_blocks` > 0 gives every prefill/colocated worker a fake prefix cache of that many blocks
    (`kv_events.FakeKVWorker`), which publishes KV events to the router's prefix index."""
    base = worker or FakeWorkerConfig()
    counts = {"prefill": n_prefill, "decode": n_decode} if mode == "disagg" else {}
    if mode == "colocated":
        counts = {"colocated": n_colocated}
    groups: dict[str, list[FakeWorker]] = {"prefill": [], "decode": [], "colocated": []}
    for role, n in counts.items():
        for _ in range(n):
            w = FakeWorker(replace(base, role=role))
            if kv_blocks and role != "decode":
                w.kv = FakeKVWorker("", num_blocks=kv_blocks, block_size=base.block_size)
            await w.start()
            groups[role].append(w)
    router_kw.setdefault("status_poll_interval_s", 0.2)
    config = RouterConfig(
        model_dir=model_dir,
        mode=mode,  # type: ignore[arg-type]
        prefill_addrs=tuple(w.address for w in groups["prefill"]),
        decode_addrs=tuple(w.address for w in groups["decode"]),
        colocated_addrs=tuple(w.address for w in groups["colocated"]),
        **router_kw,
    )
    handle = await start_router(config)
    channel = grpc.aio.insecure_channel(handle.address, options=[("grpc.enable_http_proxy", 0)])
    cluster = FakeCluster(handle, groups["prefill"], groups["decode"], groups["colocated"], channel)
    try:
        yield cluster
    finally:
        await channel.close()
        await handle.stop(grace_s=0.2)
        for w in cluster.workers:
            await w.stop()
