"""The simulator's KV transport: the `kvtransfer.base.KVTransport` seam with no bytes and no
clock of its own. Pure; one per simulated worker, under its hand-off owner
(`worker.kv_handoff.KVHandoff`, in `sim_engine.SimEngine`).

`expect` and `open` record the transfer; nothing moves. Virtual time decides when a transfer
is done: the simulator calls `land(transfer_id)` on both sides' transports, and each side's
next `poll()` returns its ok result; `cancel` makes the next `poll()` return a failed one (the
simulated transfer stops at once). Deadlines are the simulator's, not the transport's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

from kvtransfer.types import PeerEndpoint, TransferResult, TransferTicket
from model_runtime.kv_cache import KVLayout


def sim_layout(block_size: int) -> KVLayout:
    """The one KV layout every simulated worker has (only the block size means anything)."""
    return KVLayout("sim", "sim", block_size, 1, 1, 1, "sim")


class SimTransport:
    """A `KVTransport` whose transfers end when the simulator says (module docstring)."""

    def __init__(self, worker_id: str, layout: KVLayout) -> None:
        self._endpoint = PeerEndpoint(worker_id, "sim", 0)
        self._layout = layout
        self._open: dict[str, tuple[TransferTicket, Literal["send", "recv"]]] = {}
        self._results: list[TransferResult] = []

    @property
    def endpoint(self) -> PeerEndpoint:
        return self._endpoint

    @property
    def layout(self) -> KVLayout:
        return self._layout

    def expect(self, ticket: TransferTicket) -> None:
        self._start(ticket, "recv")

    def open(self, ticket: TransferTicket, src_block_ids: Sequence[int]) -> None:
        self._start(ticket, "send")

    def _start(self, ticket: TransferTicket, role: Literal["send", "recv"]) -> None:
        if ticket.transfer_id in self._open:
            raise ValueError(f"transfer {ticket.transfer_id} is already open")
        self._open[ticket.transfer_id] = (ticket, role)

    def send_layer(self, transfer_id: str, layer: int) -> None:
        """Nothing moves: the simulator prices the transfer as a whole."""

    def land(self, transfer_id: str) -> None:
        """The simulated transfer is done: the next `poll()` reports it ok."""
        self._end(transfer_id, None)

    def cancel(self, transfer_id: str) -> None:
        self._end(transfer_id, "cancelled")

    def _end(self, transfer_id: str, error: str | None) -> None:
        ticket, role = self._open.pop(transfer_id)
        self._results.append(
            TransferResult(
                transfer_id, ticket.epoch, ticket.request_id, role, "sim", error is None, error
            )
        )

    def poll(self) -> list[TransferResult]:
        out, self._results = self._results, []
        return out

    def set_waker(self, waker: Callable[[], None] | None) -> None:
        """No thread ever has news the simulator did not make."""

    def close(self) -> None:
        for transfer_id in list(self._open):
            self._end(transfer_id, "transport closed")
