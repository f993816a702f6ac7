"""`python -m router`: run a router process until SIGINT/SIGTERM.

Prints one line ``pdserve-router ready host=<host> port=<port>`` on stdout once it serves (the
port is the bound one, useful with ``--port 0``), followed by `` http_port=<port>`` when the
HTTP front runs (``--http-port``). Exit status 2 on a bad argument or config.

``--config FILE`` is how the launchers start a router: FILE is its whole `RouterConfig` as JSON
(built once from the cluster config, `deploy.config.ClusterConfig.router_config`, written by
`deploy.launcher`), and no other flag but `--log-level` may come with it. The other flags are
for people running a router by hand.

Secrets never come on the command line: the cluster secret comes from
``PDSERVE_CLUSTER_SECRET`` or `--cluster-secret-file`, a Redis password from
``PDSERVE_REDIS_PASSWORD`` or the index config's `password_file`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr, TypeAdapter, ValidationError

from router.app import start_router
from router.config import RouterConfig
from router.hybrid import HybridConfig
from router.policies import POLICIES
from router.prefix_index.config import (
    REDIS_PASSWORD_ENV,
    PrefixIndexConfig,
    RedisIndexConfig,
)
from router.ratio.config import RatioConfig
from security.cli import add_server_security_args, server_security_overrides
from security.config import SecurityConfig


def _security(args: argparse.Namespace) -> SecurityConfig:
    """`--security-json`, with the security flags on top."""
    data: dict[str, Any] = SecurityConfig.model_validate_json(
        args.security_json or "{}"
    ).model_dump(exclude_unset=True)
    for key, value in server_security_overrides(args, "").items():
        if value is not None:
            data[key.lstrip(".")] = value
    return SecurityConfig.model_validate(data)


NOT_CONFIG_FLAGS = ("--config", "--log-level")
"""The flags that may come with ``--config`` (none of them sets a `RouterConfig` field)."""


def load_config(path: str | Path) -> RouterConfig:
    """The router's whole config from its document: a `RouterConfig` as JSON, what the
    launchers write, with the Redis password (never in the document) from
    ``PDSERVE_REDIS_PASSWORD``. Raises OSError for an unreadable file,
    pydantic.ValidationError (a ValueError) for a bad document."""
    config = RouterConfig.model_validate_json(Path(path).read_bytes())
    index = _with_password(config.prefix_index)
    return (
        config
        if index is config.prefix_index
        else config.model_copy(update={"prefix_index": index})
    )


def _with_password(index: PrefixIndexConfig) -> PrefixIndexConfig:
    """`index` with the Redis password of the environment (read once, then removed)."""
    password = os.environ.pop(REDIS_PASSWORD_ENV, None)
    if password and isinstance(index, RedisIndexConfig):
        index = RedisIndexConfig.model_validate(
            {**index.model_dump(), "password": SecretStr(password)}
        )
    return index


def _prefix_index(args: argparse.Namespace) -> PrefixIndexConfig:
    """`--prefix-index-json`, else `--redis-url`; a Redis password from the environment."""
    if args.prefix_index_json:
        index = TypeAdapter(PrefixIndexConfig).validate_json(args.prefix_index_json)
    else:
        index = RouterConfig.prefix_index_from_url(args.redis_url)
    return _with_password(index)


def _addrs(values: list[str] | None) -> tuple[str, ...]:
    """Repeated flags and comma-separated lists both work: `-a h:1 -a h:2` == `-a h:1,h:2`."""
    return tuple(a.strip() for v in values or [] for a in v.split(",") if a.strip())


def parse_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Command line -> validated `RouterConfig` (exits with status 2 on errors)."""
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    p.add_argument(
        "--config",
        help="the whole RouterConfig as a JSON file (what the launchers pass); excludes every "
        "other config flag",
    )
    p.add_argument("--model", help="HF model folder (required without --config)")
    p.add_argument("--model-name", default=None, help="name reported by GetModelInfo")
    p.add_argument("--mode", choices=("disagg", "colocated"), default="disagg")
    p.add_argument("--policy", choices=sorted(POLICIES), default="prefix_aware")
    p.add_argument(
        "--redis-url",
        default=None,
        help="shared prefix index in Redis (redis://host:port/db); default: in-memory",
    )
    p.add_argument("--prefill-addr", action="append", help="prefill worker host:port")
    p.add_argument("--decode-addr", action="append", help="decode worker host:port")
    p.add_argument("--colocated-addr", action="append", help="colocated worker host:port")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=0, help="0 picks a free port")
    p.add_argument(
        "--http-port",
        type=int,
        default=None,
        help="OpenAI-compatible HTTP API (and /metrics) on this port; 0 picks a free one",
    )
    p.add_argument("--max-inflight", type=int, default=64)
    p.add_argument("--max-queued", type=int, default=256)
    p.add_argument("--default-timeout-s", type=float, default=120.0)
    p.add_argument("--status-poll-interval-s", type=float, default=0.5)
    p.add_argument("--status-poll-timeout-s", type=float, default=0.5)
    p.add_argument("--status-poll-misses", type=int, default=3)
    p.add_argument(
        "--stall-timeout-s",
        type=float,
        default=RouterConfig.model_fields["stall_timeout_s"].default,
        help="a worker stream silent this long is checked; a frozen worker's request moves",
    )
    p.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=RouterConfig.model_fields["shutdown_grace_s"].default,
        help="on SIGTERM, how long running streams may finish",
    )
    p.add_argument(
        "--max-migrations",
        type=int,
        default=RouterConfig.model_fields["max_migrations"].default,
        help="times a request moves off a decode worker that failed mid-stream",
    )
    p.add_argument(
        "--ratio-json",
        default=None,
        help="ratio controller settings as JSON (a RatioConfig, e.g. "
        '\'{"mode": "advisory", "slo_ttft_ms": 500, "slo_tpot_ms": 50}\'); default: off',
    )
    p.add_argument(
        "--hybrid-json",
        default=None,
        help="conditional disaggregation as JSON (a router.hybrid HybridConfig, e.g. "
        "'{\"local_prefill_max_tokens\": 256}'); default: off",
    )
    p.add_argument(
        "--prefix-index-json",
        default=None,
        help="prefix index settings as JSON (a MemoryIndexConfig / RedisIndexConfig without "
        "a password; overrides --redis-url)",
    )
    p.add_argument(
        "--security-json",
        default=None,
        help="security settings as JSON (a SecurityConfig: file paths only); flags override",
    )
    add_server_security_args(p)
    p.add_argument("--log-level", default="INFO")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.config:
        extra = [a for a in argv if a.startswith("--") and a.split("=")[0] not in NOT_CONFIG_FLAGS]
        if extra:
            p.error(f"--config takes no other config flag, got {extra}")
        try:
            return load_config(args.config)
        except (OSError, ValidationError) as exc:
            p.error(f"--config {args.config}: {exc}")
    if not args.model:
        p.error("--model is required without --config")
    try:
        return RouterConfig(
            model_dir=args.model,
            model_name=args.model_name,
            mode=args.mode,
            policy=args.policy,
            prefill_addrs=_addrs(args.prefill_addr),
            decode_addrs=_addrs(args.decode_addr),
            colocated_addrs=_addrs(args.colocated_addr),
            host=args.host,
            port=args.port,
            http_port=args.http_port,
            max_inflight=args.max_inflight,
            max_queued=args.max_queued,
            default_timeout_s=args.default_timeout_s,
            status_poll_interval_s=args.status_poll_interval_s,
            status_poll_timeout_s=args.status_poll_timeout_s,
            status_poll_misses=args.status_poll_misses,
            max_migrations=args.max_migrations,
            stall_timeout_s=args.stall_timeout_s,
            shutdown_grace_s=args.shutdown_grace_s,
            prefix_index=_prefix_index(args),
            ratio=RatioConfig.model_validate_json(args.ratio_json or "{}"),
            hybrid=HybridConfig.model_validate_json(args.hybrid_json or "{}"),
            security=_security(args),
        )
    except ValidationError as exc:
        p.error(str(exc))


async def serve(config: RouterConfig) -> None:
    """Start the router, announce the port, run until a stop signal."""
    handle = await start_router(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    http = f" http_port={handle.http.port}" if handle.http is not None else ""
    print(f"pdserve-router ready host={config.host} port={handle.port}{http}", flush=True)
    await stop.wait()
    await handle.stop()


def main(argv: Sequence[str] | None = None) -> int:
    config = parse_args(argv)
    try:
        asyncio.run(serve(config))
    except ValueError as exc:  # e.g. an unusable model folder
        print(f"router: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
