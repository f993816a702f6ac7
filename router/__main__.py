"""`python -m router`: run a router process until SIGINT/SIGTERM.

Prints one line ``pdserve-router ready host=<host> port=<port>`` on stdout once it serves (the
port is the bound one, useful with ``--port 0``), followed by `` http_port=<port>`` when the
HTTP front runs (``--http-port``). Exit status 2 on a bad argument or config.

``--config FILE`` is how the launchers start a router: FILE is its whole `RouterConfig` as JSON
(built once from the cluster config, `deploy.config.ClusterConfig.router_config`, written by
`deploy.launcher`), and no other flag but `--log-level` and ``--set`` may come with it. The
other flags are for people running a router by hand: one per `RouterConfig` field, derived
from the model (`cliflags.model_flags`: ``--policy``, ``--max-inflight``, ``--http-port``,
``--ratio-json JSON``, ``--hybrid-json JSON``, ...; ``--model`` sets ``model_dir``, the
repeatable ``--prefill-addr`` / ``--decode-addr`` / ``--colocated-addr`` the address lists,
``--redis-url`` a Redis prefix index), each with the model's default and description, the
public API's security flags (`security.cli`) on top of ``--security-json``, and
``--set hybrid.local_prefill_max_tokens=256`` for any key, nested ones included.

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

from pydantic import SecretStr

from cliflags.model_flags import (
    add_model_flags,
    add_set_flag,
    apply_sets,
    flags_beside_config,
    load_document,
    model_values,
)
from router.app import start_router
from router.config import RouterConfig
from router.prefix_index.config import REDIS_PASSWORD_ENV, PrefixIndexConfig, RedisIndexConfig
from security.cli import add_server_security_args, server_security_overrides

NOT_CONFIG_FLAGS = ("--config", "--log-level", "--set")
"""The flags that may come with ``--config`` (only ``--set`` changes what it holds)."""

FLAG_NAMES = {"model_dir": "--model"}
"""`RouterConfig` fields whose flag keeps the command line's established name."""

ADDRESS_FLAGS = {
    "prefill_addrs": "--prefill-addr",
    "decode_addrs": "--decode-addr",
    "colocated_addrs": "--colocated-addr",
}
"""The address-list fields, each set by a repeatable flag that also takes comma lists."""


def load_config(path: str | Path, sets: Sequence[str] = ()) -> RouterConfig:
    """The router's whole config from its document: a `RouterConfig` as JSON, what the
    launchers write, with ``--set`` pairs laid over it and the Redis password (never in the
    document) from ``PDSERVE_REDIS_PASSWORD``. Raises OSError for an unreadable file,
    ValueError (pydantic.ValidationError included) for a bad document or pair."""
    return _with_env_password(load_document(RouterConfig, path, sets))


def _with_env_password(config: RouterConfig) -> RouterConfig:
    """`config` with its Redis index's password from the environment, if any."""
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


def _addrs(values: list[str] | None) -> tuple[str, ...]:
    """Repeated flags and comma-separated lists both work: `-a h:1 -a h:2` == `-a h:1,h:2`."""
    return tuple(a.strip() for v in values or [] for a in v.split(",") if a.strip())


def parse_args(argv: Sequence[str] | None = None) -> RouterConfig:
    """Command line -> validated `RouterConfig` (exits with status 2 on errors)."""
    p = argparse.ArgumentParser(prog="python -m router", description=__doc__)
    p.add_argument(
        "--config",
        help="the whole RouterConfig as a JSON file (what the launchers pass); excludes every "
        "other config flag but --set",
    )
    flags = add_model_flags(p, RouterConfig, names=FLAG_NAMES, skip=ADDRESS_FLAGS)
    for field, flag in ADDRESS_FLAGS.items():
        info = RouterConfig.model_fields[field]
        p.add_argument(flag, action="append", dest=field, help=f"{info.description} (repeatable)")
    p.add_argument(
        "--redis-url",
        default=None,
        help="shared prefix index in Redis (redis://host:port/db), unless --prefix-index-json "
        "(default: in-memory)",
    )
    add_server_security_args(p)
    add_set_flag(p)
    p.add_argument("--log-level", default="INFO")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if args.config:
        extra = flags_beside_config(argv, NOT_CONFIG_FLAGS)
        if extra:
            p.error(f"--config takes no other config flag but --set, got {extra}")
        try:
            return load_config(args.config, args.model_sets)
        except (OSError, ValueError) as exc:
            p.error(f"--config {args.config}: {exc}")
    try:
        fields = model_values(args, flags)
        for field in ADDRESS_FLAGS:
            if getattr(args, field):
                fields[field] = _addrs(getattr(args, field))
        if args.redis_url and "prefix_index" not in fields:
            fields["prefix_index"] = RouterConfig.prefix_index_from_url(args.redis_url).model_dump()
        security = fields.setdefault("security", {})
        for key, value in server_security_overrides(args, "").items():
            if value is not None:
                security[key.lstrip(".")] = value
        apply_sets(fields, args.model_sets)
        if "model_dir" not in fields:
            p.error("--model is required without --config")
        return _with_env_password(RouterConfig.model_validate(fields))
    except ValueError as exc:  # pydantic.ValidationError included
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
