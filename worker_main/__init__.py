"""The worker process's composition root: the table of roles a worker can take (`ROLES`) and
the entry point ``python -m worker_main --model DIR --role prefill|decode|colocated``.

It sits above the worker host (`worker`: engine thread, service, `RoleHandler` contract) and
the role packages (`prefill_worker`, `decode_worker`), which import the host; the host imports
neither this package nor a role package, so the imports form no loop.
"""

from __future__ import annotations

from decode_worker.colocated import ColocatedRole
from decode_worker.hybrid import HybridDecodeRole
from prefill_worker.prefill import PrefillRole
from security.secret import ClusterSecret
from worker.config import WorkerConfig
from worker.roles import RoleHandler
from worker.server import WorkerServer

ROLES: dict[str, type[RoleHandler]] = {
    r.name: r for r in (PrefillRole, HybridDecodeRole, ColocatedRole)
}
"""Every role a worker can take, by name (what `--role` and `SetRole` accept). The "decode"
role is `HybridDecodeRole`: Reserve + Decode, and Generate when the router sends a request's
prefill to its decode worker (`router.hybrid`; a plain decode worker otherwise)."""


def server(config: WorkerConfig, cluster_secret: ClusterSecret | None = None) -> WorkerServer:
    """A `WorkerServer` that can take every role (not started)."""
    return WorkerServer(config, ROLES, cluster_secret)
