"""Configuration of a worker's KV transport and the factory that builds it (any worker process).

A sub-model per implementation, chosen by `kind`; frozen and validated at the edge. Values
discovered at start-up (the store's bound port) live on the transport (`endpoint`), never in the
config.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from kvtransfer.base import KVTransport
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from kvtransfer.torch_dist import TorchDistTransport
from model_runtime.kv_cache import KVCache


class TorchDistConfig(BaseModel):
    """torch.distributed point-to-point (gloo for CPU caches, NCCL for CUDA caches)."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["torch_dist"] = "torch_dist"
    host: str = Field(
        "127.0.0.1",
        description="This worker's address: its rendezvous store listens here and its gloo "
        "pairs bind here. Must be reachable by the peers.",
    )
    port: int = Field(0, ge=0, le=65535, description="Store port; 0 picks a free one.")
    connect_timeout_s: float = Field(
        10.0, gt=0, description="Bound on joining a peer (never above a transfer's deadline)."
    )
    serve: bool = Field(
        True, description="Serve a store so this worker can receive KV (decode role)."
    )


class LoopbackConfig(BaseModel):
    """Same-process transport, for tests and single-process demos."""

    model_config = ConfigDict(frozen=True)

    kind: Literal["loopback"] = "loopback"


KVTransferConfig = Annotated[TorchDistConfig | LoopbackConfig, Field(discriminator="kind")]


def make_transport(
    config: TorchDistConfig | LoopbackConfig,
    cache: KVCache,
    worker_id: str,
    hub: LoopbackHub | None = None,
) -> KVTransport:
    """Build the configured transport over `cache`; loopback needs the process's `hub`."""
    if isinstance(config, LoopbackConfig):
        if hub is None:
            raise ValueError("kind 'loopback' needs a LoopbackHub shared by its peers")
        return LoopbackTransport(hub, worker_id, cache)
    return TorchDistTransport(
        cache,
        worker_id,
        host=config.host,
        port=config.port,
        connect_timeout_s=config.connect_timeout_s,
        serve=config.serve,
    )
