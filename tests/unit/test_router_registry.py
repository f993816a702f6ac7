"""Unit tests of `router.registry.InMemoryWorkerRegistry` and `router.config.RouterConfig`."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from pydantic import ValidationError

from proto.pdserve.v1 import worker_pb2
from router.config import RouterConfig
from router.registry import InMemoryWorkerRegistry


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_register_heartbeat_fail_expire_deregister() -> None:
    async def scenario() -> None:
        clock = Clock()
        reg = InMemoryWorkerRegistry(ttl_s=2.0, clock=clock)
        await reg.register("h:2", "decode")
        await reg.register("h:1", "prefill")
        recs = await reg.list()
        assert [r.address for r in recs] == ["h:1", "h:2"]
        assert not any(r.healthy for r in recs)  # unknown until the first heartbeat

        await reg.heartbeat("h:1", worker_pb2.WorkerStatus(role="prefill", free_blocks=7))
        (r1, _) = await reg.list()
        assert r1.healthy and r1.status is not None and r1.status.free_blocks == 7

        await reg.heartbeat("h:1", None, "UNAVAILABLE: refused")
        await reg.heartbeat("h:1", None, "UNAVAILABLE: refused")
        (r1, _) = await reg.list()
        assert not r1.healthy and r1.consecutive_failures == 2
        assert r1.last_error == "UNAVAILABLE: refused"
        assert r1.status is not None  # the last good status is kept

        await reg.heartbeat("h:1", worker_pb2.WorkerStatus(role="decode"))
        (r1, _) = await reg.list()
        assert r1.healthy and r1.consecutive_failures == 0
        assert r1.role == "decode"  # a worker's reported role wins (role switches)

        clock.now += 2.5
        (r1, _) = await reg.list()
        assert not r1.healthy and r1.last_error == "heartbeat expired"

        assert await reg.deregister("h:1") is True
        assert await reg.deregister("h:1") is False
        with pytest.raises(KeyError):
            await reg.heartbeat("h:1", None)
        with pytest.raises(ValueError, match="role must be one of"):
            await reg.register("h:3", "router")  # type: ignore[arg-type]

    asyncio.run(scenario())


def test_config_defaults_and_errors(tmp_path: Path) -> None:
    cfg = RouterConfig(model_dir=tmp_path, prefill_addrs=("h:1",), decode_addrs=("h:2",))
    assert (cfg.mode, cfg.policy, cfg.port, cfg.host) == ("disagg", "prefix_aware", 0, "127.0.0.1")
    assert cfg.served_model_name == tmp_path.name
    with pytest.raises(ValidationError):
        cfg.port = 5  # frozen
    bad: list[tuple[dict[str, object], str]] = [
        ({"prefill_addrs": ("h:1",)}, "needs prefill_addrs and decode_addrs"),
        ({"prefill_addrs": ("h:1",), "decode_addrs": ("h:1",)}, "listed as prefill and decode"),
        ({"prefill_addrs": ("nohost",), "decode_addrs": ("h:2",)}, "host:port"),
        ({"prefill_addrs": ("h:1", "h:1"), "decode_addrs": ("h:2",)}, "duplicate"),
        ({"mode": "colocated"}, "needs colocated_addrs"),
        ({"mode": "colocated", "colocated_addrs": ("h:1",), "decode_addrs": ("h:2",)}, "empty"),
        ({"policy": "nope", "prefill_addrs": ("h:1",), "decode_addrs": ("h:2",)}, "policy"),
        ({"max_inflight": 0, "prefill_addrs": ("h:1",), "decode_addrs": ("h:2",)}, "max_inflight"),
        ({"bogus": 1, "prefill_addrs": ("h:1",), "decode_addrs": ("h:2",)}, "bogus"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ValidationError, match=message):
            RouterConfig(model_dir=tmp_path, **kwargs)  # type: ignore[arg-type]
