"""Security settings (`SecurityConfig`, `InternalTLS`): frozen pydantic models of file paths.

Used by the router (`RouterConfig.security`), the cluster TOML (`[security]`), the worker
(`WorkerConfig.internal_tls`) and the CLI. No secret is ever a field here: a model holds where
the certificate, key, token file or secret file is, and the files are read when a server
starts (`check_files` names the field of a file that is not there). Torch-free.
"""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, model_validator

DEFAULT_INTERNAL_NAME = "pdserve-internal"


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IP literals (127.0.0.0/8, ::1); every other name,
    the wildcard '0.0.0.0' / '::' and '' (all interfaces) are not loopback."""
    name = host.strip().strip("[]")
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def _check_readable(path: Path | None, field: str) -> None:
    if path is None:
        return
    if not path.is_file() or not os.access(path, os.R_OK):
        raise ValueError(f"{field}: {str(path)!r} is not a readable file")


class InternalTLS(BaseModel):
    """Mutual TLS between the router and the workers (`[security.internal]`).

    Every worker serves with `tls_cert`/`tls_key` and accepts only clients whose certificate
    `tls_ca` signed; the router presents the same certificate as its client certificate and
    checks the worker's against `tls_ca`. One certificate for the whole cluster: it must allow
    server and client authentication and name `server_name` (the router verifies that name,
    whatever address a worker has, so one certificate covers every node)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tls_cert: Path = Field(description="Cluster certificate (PEM), server and client use.")
    tls_key: Path = Field(description="Its private key (PEM).")
    tls_ca: Path = Field(description="CA (PEM) that signed the cluster certificate.")
    server_name: str = Field(
        default=DEFAULT_INTERNAL_NAME,
        min_length=1,
        description="Name the router expects in a worker's certificate (a SAN of tls_cert).",
    )

    def check_files(self, prefix: str = "security.internal") -> None:
        """ValueError naming the first field whose file cannot be read."""
        for name in ("tls_cert", "tls_key", "tls_ca"):
            _check_readable(getattr(self, name), f"{prefix}.{name}")


class SecurityConfig(BaseModel):
    """Who may call the public API and how the cluster's own planes are closed (`[security]`).

    Public API: TLS with `tls_cert` + `tls_key`; mutual TLS with `tls_client_ca` as well;
    bearer tokens from `auth_token_file`. Internal planes: the cluster secret (generated at
    start unless `cluster_secret_file` or ``PDSERVE_CLUSTER_SECRET`` gives one) and, with
    `internal`, mutual TLS between router and workers. A public address that is not loopback
    needs TLS and a token file unless `insecure` (`check_bind`)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tls_cert: Path | None = Field(default=None, description="Server certificate chain (PEM).")
    tls_key: Path | None = Field(default=None, description="Its private key (PEM).")
    tls_client_ca: Path | None = Field(
        default=None,
        description="CA (PEM) for mutual TLS: clients must present a certificate it signed.",
    )
    auth_token_file: Path | None = Field(
        default=None,
        description="Bearer tokens, one per line ('#' starts a comment); re-read when it "
        "changes. Calls without one of them get UNAUTHENTICATED (HTTP 401).",
    )
    token_reload_s: float = Field(
        default=1.0, gt=0, description="How often the token file is checked for changes."
    )
    metrics_public: bool = Field(
        default=False, description="Serve /metrics without a token (it needs one by default)."
    )
    insecure: bool = Field(
        default=False,
        description="Allow serving a non-loopback address without TLS and a token file.",
    )
    cluster_secret_file: Path | None = Field(
        default=None,
        description="File (mode 0600) holding the cluster secret as hex, for clusters whose "
        "processes are started separately; default: PDSERVE_CLUSTER_SECRET, else generated.",
    )
    internal: InternalTLS | None = Field(
        default=None, description="Mutual TLS between router and workers (off by default)."
    )

    @model_validator(mode="after")
    def _pairs(self) -> SecurityConfig:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError(
                "security.tls_cert and security.tls_key go together, got "
                f"tls_cert={self.tls_cert}, tls_key={self.tls_key}"
            )
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise ValueError(
                "security.tls_client_ca (mutual TLS) needs security.tls_cert and tls_key"
            )
        return self

    @property
    def tls(self) -> bool:
        """True when the public API is served over TLS."""
        return self.tls_cert is not None

    @property
    def auth(self) -> bool:
        """True when public calls need a bearer token."""
        return self.auth_token_file is not None

    def check_bind(self, host: str, field: str = "router.host") -> None:
        """ValueError (saying why) when `host` is not loopback and the API there would be
        served without TLS or without a token, unless `insecure`."""
        if self.insecure or is_loopback(host) or (self.tls and self.auth):
            return
        missing = [
            what
            for what, ok in (
                ("TLS (security.tls_cert + security.tls_key, --tls-cert/--tls-key)", self.tls),
                ("token file (security.auth_token_file, --auth-token-file)", self.auth),
            )
            if not ok
        ]
        raise ValueError(
            f"{field}={host!r} is not a loopback address, so anyone on the network could reach "
            f"the API, and it has no {' and no '.join(missing)}: requests and tokens would "
            "cross the network in clear text or need no credentials. Configure both, bind "
            "127.0.0.1, or pass --insecure (security.insecure = true) to serve it anyway."
        )

    def check_files(self, prefix: str = "security") -> None:
        """ValueError naming the first configured file that cannot be read."""
        for name in ("tls_cert", "tls_key", "tls_client_ca", "auth_token_file"):
            _check_readable(getattr(self, name), f"{prefix}.{name}")
        if self.internal is not None:
            self.internal.check_files(f"{prefix}.internal")
