"""Command-line flags of the security settings, shared by every command. Torch-free.

Runs in the CLI process. Servers (`pdserve up`, `python -m router`) take
`add_server_security_args` and turn the parsed flags into dotted overrides of `[security]`
(`server_security_overrides`); clients (`pdserve generate`, `pdserve bench`) take
`add_client_security_args` and build a `ClientSecurity` (`client_security`). Flags name files,
never a secret itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from security.channels import ClientSecurity


def add_server_security_args(parser: argparse.ArgumentParser) -> None:
    """The public API's TLS / mTLS / token flags and the cluster secret file."""
    g = parser.add_argument_group(
        "security", "TLS, mutual TLS and bearer tokens on the public API (docs/security.md)"
    )
    g.add_argument(
        "--tls-cert",
        metavar="FILE",
        help="serve TLS with this certificate (PEM) (default: plaintext)",
    )
    g.add_argument(
        "--tls-key", metavar="FILE", help="private key (PEM) of --tls-cert (default: none)"
    )
    g.add_argument(
        "--tls-client-ca",
        metavar="FILE",
        help="mutual TLS: clients must present a certificate this CA (PEM) signed "
        "(default: no client certificate asked for)",
    )
    g.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="bearer tokens, one per line (re-read when it changes); calls need one "
        "(default: no token needed)",
    )
    g.add_argument(
        "--metrics-public", action="store_true", default=None, help="/metrics without a token"
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback --host without TLS and a token file (default: refuse)",
    )
    g.add_argument(
        "--cluster-secret-file",
        metavar="FILE",
        help="cluster secret (hex, mode 0600) shared by every process of a multi-node cluster "
        "(default: PDSERVE_CLUSTER_SECRET, else a fresh one)",
    )


def server_security_overrides(args: argparse.Namespace, prefix: str = "security") -> dict[str, Any]:
    """Dotted `[security]` keys set by the flags of `add_server_security_args` (None: unset)."""
    return {
        f"{prefix}.tls_cert": args.tls_cert,
        f"{prefix}.tls_key": args.tls_key,
        f"{prefix}.tls_client_ca": args.tls_client_ca,
        f"{prefix}.auth_token_file": args.auth_token_file,
        f"{prefix}.metrics_public": args.metrics_public,
        f"{prefix}.insecure": args.insecure,
        f"{prefix}.cluster_secret_file": args.cluster_secret_file,
    }


def add_client_security_args(parser: argparse.ArgumentParser) -> None:
    """A client's TLS / mTLS / token flags."""
    g = parser.add_argument_group("security", "how to reach a router that needs TLS or tokens")
    g.add_argument("--tls", action="store_true", help="use TLS (implied by --tls-ca)")
    g.add_argument(
        "--tls-ca",
        metavar="FILE",
        help="CA (PEM) that signed the router's cert (default: the system's roots, with --tls)",
    )
    g.add_argument(
        "--tls-cert", metavar="FILE", help="client certificate (PEM) for mutual TLS (default: none)"
    )
    g.add_argument(
        "--tls-key", metavar="FILE", help="private key (PEM) of --tls-cert (default: none)"
    )
    g.add_argument(
        "--tls-server-name",
        metavar="NAME",
        help="name to expect in the router's certificate (default: the host dialled)",
    )
    g.add_argument(
        "--auth-token-file",
        metavar="FILE",
        help="file whose first token is sent as Bearer (default: no token)",
    )


def _path(value: str | None) -> Path | None:
    return None if value is None else Path(value)


def client_security(args: argparse.Namespace) -> ClientSecurity:
    """The `ClientSecurity` of the flags of `add_client_security_args`."""
    return ClientSecurity(
        tls=bool(args.tls),
        tls_ca=_path(args.tls_ca),
        tls_cert=_path(args.tls_cert),
        tls_key=_path(args.tls_key),
        auth_token_file=_path(args.auth_token_file),
        server_name=args.tls_server_name,
    )
