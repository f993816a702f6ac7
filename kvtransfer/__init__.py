"""KV transfer between prefill and decode workers: the transport seam and its implementations.

`kvtransfer.base.KVTransport` is the seam (with the ownership rules); `LoopbackTransport` is
the same-process implementation, `TorchDistTransport` the torch.distributed one.
"""

from kvtransfer.base import KVTransport
from kvtransfer.loopback import LoopbackHub, LoopbackTransport
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import (
    Code,
    LayoutMismatchError,
    PeerEndpoint,
    TransferError,
    TransferResult,
    TransferTicket,
    blocks_needed,
    new_ticket,
)

__all__ = [
    "Code",
    "KVTransport",
    "LayoutMismatchError",
    "LoopbackHub",
    "LoopbackTransport",
    "PeerEndpoint",
    "TorchDistTransport",
    "TransferError",
    "TransferResult",
    "TransferTicket",
    "blocks_needed",
    "new_ticket",
]
