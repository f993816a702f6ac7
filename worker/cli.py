"""The worker process's command line: ``python -m worker_main`` (`worker_main/__main__.py`).

    python -m worker_main --config FILE [--set KEY=VALUE ...] [--log-level LEVEL]
        [--cluster-secret-file FILE]
    python -m worker_main --model DIR --role prefill|decode|colocated [--FIELD VALUE ...]
        [--set KEY=VALUE ...] [--log-level LEVEL] [--cluster-secret-file FILE]

``--config FILE`` is how the launchers start a worker: FILE is the worker's whole `WorkerConfig`
as JSON (built once from the cluster config, `deploy.config.ClusterConfig.worker_config`), and
no other config flag may come with it but ``--set``. The other flags are for people running a
worker by hand: one per `WorkerConfig` field, derived from the model (`cliflags.model_flags`:
``--worker-id``, ``--port``, ``--torch-threads``, ``--nice``, ``--kv-shared-memory`` /
``--no-kv-shared-memory``, ``--engine-json JSON``, ...; ``--model`` sets ``model_dir``, and
``--metrics-port -1`` or ``none`` serves no metrics), each with the model's default and
description, and ``--set engine.block_size=8`` for any key, nested ones included.

It prints exactly one line ``PDSERVE_WORKER_READY host:port`` on stdout once its gRPC server
answers health checks with SERVING (logs go to stderr), and stops cleanly on SIGTERM / SIGINT:
no new work, in-flight work gets `--stop-grace-s` to finish, the rest is aborted, every KV
block released, the transport closed. Started by a launcher that names itself in
``PDSERVE_PARENT_PID``, it stops the same way (grace at most 1 s) when that launcher dies
(`worker.parent_watch`).

The cluster secret comes from ``PDSERVE_CLUSTER_SECRET`` (removed from this process's
environment once read, so nothing it starts inherits it) or `--cluster-secret-file` (mode
0600), never from the command line.
"""

from __future__ import annotations

import argparse
import enum
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from cliflags.model_flags import (
    add_model_flags,
    add_set_flag,
    apply_sets,
    flags_beside_config,
    load_document,
    model_values,
)
from security.secret import ClusterSecret
from worker.config import READY_PREFIX, WorkerConfig
from worker.parent_watch import ParentWatch, parent_pid_from_env
from worker.roles import RoleHandler
from worker.server import WorkerServer

log = logging.getLogger("pdserve.worker")

ORPHAN_GRACE_S = 1.0  # the stop grace of a worker whose launcher died
THREAD_EXIT_WAIT_S = 2.0  # how long a stopped worker waits for its threads before leaving
SIGNAL_CHECK_S = 0.2  # how often the main thread wakes to run signal handlers (see main)


class StopReason(enum.Enum):
    """What ended the worker's serving."""

    SIGNAL = "signal received"  # SIGTERM or SIGINT
    LAUNCHER_GONE = "launcher gone"  # `ParentWatch` saw the launcher die


NOT_CONFIG_FLAGS = ("--config", "--log-level", "--cluster-secret-file", "--set")
"""The flags that may come with ``--config`` (only ``--set`` changes what it holds)."""

FLAG_NAMES = {"model_dir": "--model"}
"""`WorkerConfig` fields whose flag keeps the command line's established name."""


def load_config(path: str | Path, sets: Sequence[str] = ()) -> WorkerConfig:
    """The worker's whole config from its document: a `WorkerConfig` as JSON, what the
    launchers write (`deploy.config.ClusterConfig.worker_config`), with ``--set`` pairs laid
    over it. Raises OSError for an unreadable file, ValueError (pydantic.ValidationError
    included) for a bad document or pair."""
    return load_document(WorkerConfig, path, sets)


def parse_args(
    argv: Sequence[str] | None = None,
) -> tuple[WorkerConfig, ClusterSecret | None]:
    """(config, cluster secret) from the command line and the environment: the ``--config``
    document, else the config flags; argparse exits on bad usage, a bad document or secret
    raises ValueError."""
    p = argparse.ArgumentParser(
        prog="python -m worker_main", description="One pdserve worker process."
    )
    p.add_argument(
        "--config",
        help="the whole WorkerConfig as a JSON file (what the launchers pass); excludes "
        "every other config flag but --set",
    )
    flags = add_model_flags(p, WorkerConfig, names=FLAG_NAMES)
    add_set_flag(p)
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--cluster-secret-file", help="cluster secret (hex, mode 0600)")
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    secret = ClusterSecret.from_env(remove=True)
    if args.cluster_secret_file:
        secret = ClusterSecret.from_file(Path(args.cluster_secret_file), "--cluster-secret-file")
    if args.config:
        extra = flags_beside_config(argv, NOT_CONFIG_FLAGS)
        if extra:
            p.error(f"--config takes no other config flag but --set, got {extra}")
        return load_config(args.config, args.model_sets), secret
    fields = model_values(args, flags)
    if fields.get("metrics_port") == "-1":  # the established spelling of "no exporter"
        fields["metrics_port"] = None
    apply_sets(fields, args.model_sets)
    if "model_dir" not in fields or "role" not in fields:
        p.error("--model and --role are required without --config")
    return WorkerConfig.model_validate(fields), secret


def main(roles: Mapping[str, type[RoleHandler]], argv: Sequence[str] | None = None) -> int:
    """Run one worker process that can take any of `roles` (`worker_main.ROLES`)."""
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    try:
        config, secret = parse_args(argv)
    except (OSError, ValueError) as exc:  # pydantic ValidationError included
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    grace_s = config.stop_grace_s
    # Why to stop, appended by a signal handler or the parent watch. Lock-free on purpose: a
    # Python signal handler runs on the main thread between any two bytecodes, even inside
    # an Event's own lock, so one that set an Event could wait on itself forever.
    requested: list[StopReason] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: requested.append(StopReason.SIGNAL))
    try:
        parent = parent_pid_from_env()
    except ValueError as exc:
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    watch = (
        ParentWatch(parent, lambda: requested.append(StopReason.LAUNCHER_GONE))
        if parent is not None
        else None
    )
    server = WorkerServer(config, roles, secret)
    try:
        server.start()
    except ValueError as exc:  # e.g. a public host without a cluster secret
        print(f"worker: {exc}", file=sys.stderr)
        return 2
    print(f"{READY_PREFIX} {server.address}", flush=True)
    # A signal may land on any thread (one sent while the process was stopped goes to whichever
    # thread runs first after SIGCONT), and its Python handler runs only when the main thread
    # next runs bytecode: an untimed wait here would never see that SIGTERM.
    while not requested:
        time.sleep(SIGNAL_CHECK_S)
    if watch is not None:
        watch.stop()
    # Nobody is left to wait for an orphan's answers, whatever else asked it to stop.
    why = StopReason.LAUNCHER_GONE if StopReason.LAUNCHER_GONE in requested else requested[0]
    if why is StopReason.LAUNCHER_GONE:
        grace_s = min(grace_s, ORPHAN_GRACE_S)
    log.info("%s; stopping (grace %.1f s)", why.value, grace_s)
    server.stop(grace_s)
    if not wait_for_threads(THREAD_EXIT_WAIT_S):
        # A helper is still inside native code (a KV store connect to a frozen or dead peer
        # retries for up to twice the connect timeout). Returning into an interpreter that
        # is shutting down would abort the process (SIGABRT, not exit 0); everything of ours
        # is stopped, so flush and leave without the interpreter's teardown.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def wait_for_threads(timeout_s: float) -> bool:
    """Give this worker's own threads still running after `stop` (non-daemon ones and the KV
    helpers, ``kvx-*``) up to `timeout_s` in all to end; whether all did (each one still
    running is logged). Library daemon threads (grpc's poller) are not waited for."""
    end = time.monotonic() + timeout_s
    ended = True
    for thread in threading.enumerate():
        ours = not thread.daemon or thread.name.startswith("kvx-")
        if thread is not threading.current_thread() and ours:
            thread.join(max(0.0, end - time.monotonic()))
            if thread.is_alive():
                log.warning("thread %s still running at exit", thread.name)
                ended = False
    return ended
