"""Certificates minted for a test (`trustme`): a CA, a server and a client certificate as PEM
files in a folder. Runs in the test process; nothing is downloaded or shared between runs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import trustme


@dataclass(frozen=True)
class CertSet:
    """PEM files of one CA and the certificates it issued (each valid for client and server
    authentication, as trustme issues them)."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def mint(folder: Path, *names: str) -> CertSet:
    """A new CA, a server certificate for `names` (default: localhost, 127.0.0.1 and the
    internal-plane name) and a client certificate, written under `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    ca = trustme.CA()
    server = ca.issue_cert(*(names or ("localhost", "127.0.0.1", "pdserve-internal")))
    client = ca.issue_cert("client.pdserve.test")
    out = CertSet(
        ca=folder / "ca.pem",
        server_cert=folder / "server.pem",
        server_key=folder / "server.key",
        client_cert=folder / "client.pem",
        client_key=folder / "client.key",
    )
    ca.cert_pem.write_to_path(str(out.ca))
    server.cert_chain_pems[0].write_to_path(str(out.server_cert))
    server.private_key_pem.write_to_path(str(out.server_key))
    client.cert_chain_pems[0].write_to_path(str(out.client_cert))
    client.private_key_pem.write_to_path(str(out.client_key))
    return out
