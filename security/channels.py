"""How a process dials and serves under the cluster's security settings. Torch-free.

- `InternalAuth` (router, workers, launchers, tests): the worker API's side. A worker server
  gets the cluster-secret interceptor and, with `InternalTLS`, a mutual-TLS port; a caller
  (the router's worker pool) gets channels that present the cluster certificate and stubs
  whose every call carries the worker token.
- `ClientSecurity` (`pdserve generate`, `pdserve bench`, tests): the public API's side. TLS
  with a CA (and a client certificate for mutual TLS), and the first token of a token file as
  ``authorization: Bearer``: native call credentials over TLS, a metadata interceptor on a
  plain (loopback) channel.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc

from security.config import InternalTLS
from security.grpc_auth import (
    AUTHORIZATION,
    WORKER_AUTH,
    ClusterSecretInterceptor,
    MetadataInterceptor,
    SyncMetadataInterceptor,
    with_metadata,
)
from security.secret import ClusterSecret
from security.tls import channel_credentials, server_credentials
from security.tokens import parse_tokens

Options = Sequence[tuple[str, str | int]]
S = TypeVar("S")


@dataclass(frozen=True)
class InternalAuth:
    """The worker API's credentials: the cluster secret (None: calls are not authenticated)
    and optional mutual TLS."""

    secret: ClusterSecret | None = None
    tls: InternalTLS | None = None

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """What every call to a worker carries (empty without a secret)."""
        return () if self.secret is None else ((WORKER_AUTH, self.secret.worker_token()),)

    def _options(self, options: Options) -> list[tuple[str, str | int]]:
        out = list(options)
        if self.tls is not None:
            out.append(("grpc.ssl_target_name_override", self.tls.server_name))
        return out

    def _credentials(self) -> grpc.ChannelCredentials:
        assert self.tls is not None
        t = self.tls
        return channel_credentials(t.tls_ca, t.tls_cert, t.tls_key, "security.internal")

    def aio_channel(self, address: str, options: Options = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to a worker (mutual TLS when configured)."""
        if self.tls is None:
            return grpc.aio.insecure_channel(address, options=list(options))
        return grpc.aio.secure_channel(address, self._credentials(), self._options(options))

    def channel(self, address: str, options: Options = ()) -> grpc.Channel:
        """A synchronous channel to a worker (tests, tools)."""
        if self.tls is None:
            return grpc.insecure_channel(address, options=list(options))
        return grpc.secure_channel(address, self._credentials(), self._options(options))

    def stub(self, stub: S) -> S:
        """`stub` (built on one of these channels) with the worker token on every call."""
        return with_metadata(stub, self.metadata)

    def server_interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        """The worker server's interceptors: the cluster-secret check, when there is one."""
        if self.secret is None:
            return []
        return [ClusterSecretInterceptor(self.secret.worker_token())]

    def add_port(self, server: grpc.aio.Server, address: str) -> int:
        """Bind `address` on a worker server (mutual TLS when configured); the bound port."""
        if self.tls is None:
            return int(server.add_insecure_port(address))
        t = self.tls
        creds = server_credentials(t.tls_cert, t.tls_key, t.tls_ca, "security.internal")
        return int(server.add_secure_port(address, creds))


@dataclass(frozen=True)
class ClientSecurity:
    """A client's credentials for the public API. TLS is on with `tls`, or when a CA or a
    client certificate is given; `tls_ca` None trusts the system's roots."""

    tls: bool = False
    tls_ca: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    auth_token_file: Path | None = None
    server_name: str | None = None

    @property
    def uses_tls(self) -> bool:
        return self.tls or self.tls_ca is not None or self.tls_cert is not None

    def to_json(self) -> dict[str, str | bool | None]:
        """JSON-able form (file paths, never a token), for a job file."""
        return {
            "tls": self.tls,
            "tls_ca": None if self.tls_ca is None else str(self.tls_ca),
            "tls_cert": None if self.tls_cert is None else str(self.tls_cert),
            "tls_key": None if self.tls_key is None else str(self.tls_key),
            "auth_token_file": None if self.auth_token_file is None else str(self.auth_token_file),
            "server_name": self.server_name,
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ClientSecurity:
        """Inverse of `to_json` (an empty mapping: plaintext, no token)."""

        def path(key: str) -> Path | None:
            value = data.get(key)
            return None if value is None else Path(str(value))

        name = data.get("server_name")
        return cls(
            tls=bool(data.get("tls", False)),
            tls_ca=path("tls_ca"),
            tls_cert=path("tls_cert"),
            tls_key=path("tls_key"),
            auth_token_file=path("auth_token_file"),
            server_name=None if name is None else str(name),
        )

    def token(self) -> str | None:
        """The first token of `auth_token_file` (None without one); ValueError when the file
        cannot be read or holds no token."""
        if self.auth_token_file is None:
            return None
        try:
            tokens = parse_tokens(self.auth_token_file.read_text())
        except OSError as exc:
            raise ValueError(
                f"--auth-token-file: cannot read {str(self.auth_token_file)!r}: {exc.strerror}"
            ) from None
        if not tokens:
            raise ValueError(f"--auth-token-file: {str(self.auth_token_file)!r} holds no token")
        return tokens[0]

    def _metadata(self) -> list[tuple[str, str]]:
        token = self.token()
        return [] if token is None else [(AUTHORIZATION, f"Bearer {token}")]

    def _tls(self, options: Options) -> tuple[grpc.ChannelCredentials, list[tuple[str, str | int]]]:
        creds = channel_credentials(self.tls_ca, self.tls_cert, self.tls_key, "client")
        token = self.token()
        if token is not None:
            creds = grpc.composite_channel_credentials(
                creds, grpc.access_token_call_credentials(token)
            )
        out = list(options)
        if self.server_name:
            out.append(("grpc.ssl_target_name_override", self.server_name))
        return creds, out

    def aio_channel(self, address: str, options: Options = ()) -> grpc.aio.Channel:
        """A grpc.aio channel to the router with these credentials."""
        if self.uses_tls:
            creds, opts = self._tls(options)
            return grpc.aio.secure_channel(address, creds, opts)
        md = self._metadata()
        interceptors = [MetadataInterceptor(md)] if md else None
        return grpc.aio.insecure_channel(address, list(options), interceptors=interceptors)

    def channel(self, address: str, options: Options = ()) -> grpc.Channel:
        """A synchronous channel to the router with these credentials."""
        if self.uses_tls:
            creds, opts = self._tls(options)
            return grpc.secure_channel(address, creds, opts)
        ch = grpc.insecure_channel(address, list(options))
        md = self._metadata()
        return grpc.intercept_channel(ch, SyncMetadataInterceptor(md)) if md else ch
