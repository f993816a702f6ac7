"""Worker roles, as the `pdserve.v1.Worker` API names them (a wire contract, like the .proto).

`WorkerStatus.role`, `SetRoleRequest.role` and the cluster config's worker counts use these
names. The one `Role` type of the code base: the router, the launchers and the workers import
it from here. Torch-free.
"""

from __future__ import annotations

from typing import Literal

Role = Literal["prefill", "decode", "colocated"]
ROLE_NAMES: tuple[Role, ...] = ("prefill", "decode", "colocated")
"""Every role name, in this order (the worker process maps each to its handler class:
`worker_main.ROLES`)."""
