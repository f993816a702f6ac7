"""The cluster secret: what the router, the workers and the KV rendezvous share. Torch-free.

Runs in every process of a cluster. `pdserve up` generates one at start (`generate`), or
reads it from a file (`security.cluster_secret_file`, which must not be readable by group or
others) or from the environment (``PDSERVE_CLUSTER_SECRET``, hex) for multi-node launches. It
reaches a worker through the launcher: the environment of a `python -m worker_main` child, or a
Ray actor's constructor argument — never a command line or a log (`repr` masks it).

The secret itself never goes over a wire: each use gets its own key, `derive(purpose)` =
HMAC-SHA256(secret, "pdserve/" + purpose) — the worker API's call token (`WORKER_GRPC`) and
the KV rendezvous records' MAC and encryption keys (`KV_RECORDS`, `KV_OFFER`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import stat
from collections.abc import Mapping, MutableMapping
from pathlib import Path

ENV_VAR = "PDSERVE_CLUSTER_SECRET"
"""Environment variable holding the secret as hex (what launchers set for their children)."""

WORKER_GRPC = "worker-grpc"
KV_RECORDS = "kv-records"
KV_OFFER = "kv-offer"

_MIN_BYTES = 16


class ClusterSecret:
    """At least 16 random bytes; `repr`/`str` never show them."""

    __slots__ = ("_raw",)

    def __init__(self, raw: bytes) -> None:
        if len(raw) < _MIN_BYTES:
            raise ValueError(f"a cluster secret needs at least {_MIN_BYTES} bytes, got {len(raw)}")
        self._raw = bytes(raw)

    @classmethod
    def generate(cls) -> ClusterSecret:
        """32 fresh random bytes (`secrets.token_bytes`)."""
        return cls(secrets.token_bytes(32))

    @classmethod
    def from_text(cls, text: str, source: str) -> ClusterSecret:
        """Parse the hex form (`to_text`); ValueError naming `source` otherwise."""
        try:
            return cls(bytes.fromhex(text.strip()))
        except ValueError as exc:
            raise ValueError(f"{source}: not a cluster secret (hex, >= 16 bytes): {exc}") from None

    @classmethod
    def from_file(cls, path: Path, field: str = "security.cluster_secret_file") -> ClusterSecret:
        """Read a secret file (hex text). ValueError naming `field` when the file is missing,
        is not a regular file, or can be read by group or others (chmod 600 it)."""
        try:
            st = path.stat()
        except OSError as exc:
            raise ValueError(f"{field}: cannot read {str(path)!r}: {exc.strerror}") from None
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"{field}: {str(path)!r} is not a regular file")
        if st.st_mode & 0o077:
            raise ValueError(
                f"{field}: {str(path)!r} is readable by group or others "
                f"(mode {stat.S_IMODE(st.st_mode):o}); run `chmod 600` on it"
            )
        return cls.from_text(path.read_text(), field)

    @classmethod
    def from_env(
        cls, environ: MutableMapping[str, str] | None = None, remove: bool = False
    ) -> ClusterSecret | None:
        """The secret in ``PDSERVE_CLUSTER_SECRET``, or None. `remove` deletes the variable
        (a worker does, so processes it starts do not inherit it)."""
        env = os.environ if environ is None else environ
        text = env.pop(ENV_VAR, None) if remove else env.get(ENV_VAR)
        return None if not text else cls.from_text(text, ENV_VAR)

    def to_text(self) -> str:
        """Hex form, for the environment of a child or a secret file."""
        return self._raw.hex()

    def write_file(self, path: Path) -> Path:
        """Write the hex form to a new file with mode 0600 (FileExistsError if it exists)."""
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.to_text() + "\n")
        return path

    def derive(self, purpose: str) -> bytes:
        """The 32-byte key of one use (HMAC-SHA256 over "pdserve/<purpose>")."""
        return hmac.new(self._raw, f"pdserve/{purpose}".encode(), hashlib.sha256).digest()

    def worker_token(self) -> str:
        """What router -> worker calls carry in their metadata (hex of `derive(WORKER_GRPC)`)."""
        return self.derive(WORKER_GRPC).hex()

    def env(self) -> dict[str, str]:
        """``{PDSERVE_CLUSTER_SECRET: hex}``, to merge into a child's environment."""
        return {ENV_VAR: self.to_text()}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ClusterSecret) and hmac.compare_digest(self._raw, other._raw)

    def __hash__(self) -> int:
        return hash(self.derive("hash"))

    def __repr__(self) -> str:
        return "ClusterSecret(***)"

    __str__ = __repr__


def resolve_cluster_secret(
    path: Path | None, environ: Mapping[str, str] | None = None, generate: bool = False
) -> ClusterSecret | None:
    """The cluster's secret: from `path` when set, else ``PDSERVE_CLUSTER_SECRET``, else a
    fresh one when `generate` (what `pdserve up` does), else None."""
    if path is not None:
        return ClusterSecret.from_file(path)
    env = dict(os.environ if environ is None else environ)
    found = ClusterSecret.from_env(env)
    if found is not None:
        return found
    return ClusterSecret.generate() if generate else None
