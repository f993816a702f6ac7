"""The worker process's command line: ``python -m worker_main`` (`worker_main/__main__.py`).

    python -m worker_main --config FILE [--log-level LEVEL] [--cluster-secret-file FILE]
    python -m worker_main --model DIR --role prefill|decode|colocated [--port 0] [--metrics-port 0]
        [--worker-id ID] [--engine-json JSON] [--torch-threads N] [--host H] [--kv-host H]
        [--kv-port P] [--transfer-timeout-s S] [--stop-grace-s S] [--log-level LEVEL]
        [--cluster-secret-file FILE] [--internal-tls-json JSON] [--insecure]

``--config FILE`` is how the launchers start a worker: FILE is the worker's whole `WorkerConfig`
as JSON (built once from the cluster config, `deploy.config.ClusterConfig.worker_config`), and
no other config flag may come with it. The other flags are for people running a worker by hand.

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

from model_runtime.engine_config import EngineConfig
from security.config import InternalTLS
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


NOT_CONFIG_FLAGS = ("--config", "--log-level", "--cluster-secret-file")
"""The flags that may come with ``--config`` (none of them sets a `WorkerConfig` field)."""


def load_config(path: str | Path) -> WorkerConfig:
    """The worker's whole config from its document: a `WorkerConfig` as JSON, what the
    launchers write (`deploy.config.ClusterConfig.worker_config`). Raises OSError for an
    unreadable file, pydantic.ValidationError (a ValueError) for a bad document."""
    return WorkerConfig.model_validate_json(Path(path).read_bytes())


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
        "every other config flag",
    )
    p.add_argument("--model", help="HF model folder (required without --config)")
    p.add_argument("--role", choices=["prefill", "decode", "colocated"])
    p.add_argument("--worker-id", help="unique worker id (default: worker-<random>)")
    p.add_argument("--host", default="127.0.0.1", help="gRPC bind address")
    p.add_argument("--port", type=int, default=0, help="gRPC port (0 = pick)")
    p.add_argument(
        "--metrics-port", type=int, default=0, help="Prometheus port (0 = pick, -1 = none)"
    )
    p.add_argument("--engine-json", default="{}", help="EngineConfig as JSON")
    p.add_argument("--torch-threads", type=int, help="torch.set_num_threads")
    p.add_argument("--nice", type=int, default=0, help="niceness to run at (0-19)")
    p.add_argument(
        "--sched-idle", action="store_true", help="run under SCHED_IDLE (see WorkerConfig)"
    )
    p.add_argument("--kv-host", default="127.0.0.1", help="KV transport address")
    p.add_argument("--kv-port", type=int, default=0, help="KV store port (0 = pick)")
    p.add_argument(
        "--kv-shared-memory",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="same-host shared-memory KV data plane (CPU)",
    )
    p.add_argument("--node", default="", help="node label (see WorkerConfig.node)")
    p.add_argument("--transfer-timeout-s", type=float, default=30.0)
    p.add_argument(
        "--stop-grace-s",
        type=float,
        default=30.0,
        help="on SIGTERM: NOT_SERVING at once, no new work, in-flight requests get this long",
    )
    p.add_argument("--log-level", default="INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    p.add_argument("--cluster-secret-file", help="cluster secret (hex, mode 0600)")
    p.add_argument("--internal-tls-json", help="mutual TLS of the worker API (InternalTLS)")
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback host without a secret"
    )
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(argv)
    logging.getLogger().setLevel(args.log_level)
    secret = ClusterSecret.from_env(remove=True)
    if args.cluster_secret_file:
        secret = ClusterSecret.from_file(Path(args.cluster_secret_file), "--cluster-secret-file")
    if args.config:
        extra = [a for a in argv if a.startswith("--") and a.split("=")[0] not in NOT_CONFIG_FLAGS]
        if extra:
            p.error(f"--config takes no other config flag, got {extra}")
        return load_config(args.config), secret
    if not args.model or not args.role:
        p.error("--model and --role are required without --config")
    fields = {
        "model_dir": args.model,
        "role": args.role,
        "host": args.host,
        "port": args.port,
        "metrics_port": None if args.metrics_port < 0 else args.metrics_port,
        "engine": EngineConfig.model_validate_json(args.engine_json),
        "torch_threads": args.torch_threads,
        "nice": args.nice,
        "sched_idle": args.sched_idle,
        "kv_host": args.kv_host,
        "kv_port": args.kv_port,
        "kv_shared_memory": args.kv_shared_memory,
        "node": args.node,
        "transfer_timeout_s": args.transfer_timeout_s,
        "stop_grace_s": args.stop_grace_s,
        "insecure": args.insecure,
    }
    if args.internal_tls_json:
        fields["internal_tls"] = InternalTLS.model_validate_json(args.internal_tls_json)
    if args.worker_id:
        fields["worker_id"] = args.worker_id
    return WorkerConfig(**fields), secret


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
