"""PEM files -> gRPC credentials. Torch-free; runs wherever a server binds or a client dials.

Every file is read when the credentials are built (a server's start, a client's first
channel); an unreadable one is a ValueError naming the setting it came from.
"""

from __future__ import annotations

from pathlib import Path

import grpc


def read_pem(path: Path, field: str) -> bytes:
    """The bytes of a PEM file; ValueError naming `field` when it cannot be read or holds no
    PEM block."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ValueError(f"{field}: cannot read {str(path)!r}: {exc.strerror}") from None
    if b"-----BEGIN " not in data:
        raise ValueError(f"{field}: {str(path)!r} holds no PEM block")
    return data


def server_credentials(
    cert: Path, key: Path, client_ca: Path | None, field: str = "security"
) -> grpc.ServerCredentials:
    """TLS for a server with `cert`/`key`; with `client_ca`, clients must present a
    certificate it signed (mutual TLS)."""
    pair = (read_pem(key, f"{field}.tls_key"), read_pem(cert, f"{field}.tls_cert"))
    if client_ca is None:
        return grpc.ssl_server_credentials([pair])
    ca = read_pem(client_ca, f"{field}.tls_client_ca")
    return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=True)


def channel_credentials(
    ca: Path | None, cert: Path | None = None, key: Path | None = None, field: str = "client"
) -> grpc.ChannelCredentials:
    """TLS for a client: trust `ca` (None: the system's roots); present `cert`/`key` as the
    client certificate when given (both or neither)."""
    if (cert is None) != (key is None):
        raise ValueError(f"{field}: a client certificate needs both its cert and its key")
    return grpc.ssl_channel_credentials(
        root_certificates=None if ca is None else read_pem(ca, f"{field}.tls_ca"),
        private_key=None if key is None else read_pem(key, f"{field}.tls_key"),
        certificate_chain=None if cert is None else read_pem(cert, f"{field}.tls_cert"),
    )
