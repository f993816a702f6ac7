"""Trailing-metadata keys of the `pdserve.v1.Worker` API (a wire contract, like the .proto).

Imported by the workers (which set them) and by the router (which reads them); torch-free.

`FAILED_PEER`: a worker whose call failed because of *another* worker — a KV transfer whose
other side died, froze or refused — answers UNAVAILABLE with this key set to the other
worker's id, so the caller blames that worker and not the one that reported it.
"""

from __future__ import annotations

from collections.abc import Iterable

FAILED_PEER = "pdserve-failed-peer"


def failed_peer(trailing: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    """The worker id under `FAILED_PEER` in a call's trailing metadata, or None."""
    for key, value in trailing or ():
        if key == FAILED_PEER:
            return value.decode() if isinstance(value, bytes) else value
    return None
