"""The worker process's composition root: the table of roles a worker can take (`ROLES`) and
the entry point ``python -m worker_main --model DIR --role prefill|decode|colocated``.

It sits above the worker host (`worker`: engine thread, service, `RoleHandler` contract,
`composite`) and the role packages (`prefill_worker`, `decode_worker`, `colocated_worker`),
which import the host and never each other; the host imports neither this package nor a role
package, so the imports form no loop.
"""

from __future__ import annotations

from colocated_worker.colocated import ColocatedRole
from decode_worker.decode import RemoteDecodeRole
from prefill_worker.prefill import PrefillRole
from security.secret import ClusterSecret
from worker.composite import compose
from worker.config import WorkerConfig
from worker.roles import RoleHandler
from worker.server import WorkerServer

DecodeWorkerRole = compose("decode", RemoteDecodeRole, ColocatedRole)
"""The "decode" role: Reserve + Decode (KV prefilled on a prefill worker), and Generate when
the router sends a request's prefill to its decode worker (`router.hybrid`; a plain decode
worker otherwise)."""

ROLES: dict[str, type[RoleHandler]] = {
    r.name: r for r in (PrefillRole, DecodeWorkerRole, ColocatedRole)
}
"""Every role a worker can take, by name (what `--role` and `SetRole` accept; the names are
`proto.pdserve.v1.roles.ROLE_NAMES`)."""


def server(config: WorkerConfig, cluster_secret: ClusterSecret | None = None) -> WorkerServer:
    """A `WorkerServer` that can take every role (not started)."""
    return WorkerServer(config, ROLES, cluster_secret)
