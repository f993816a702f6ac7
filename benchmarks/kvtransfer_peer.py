"""The decode-worker process of `benchmarks.bench_kvtransfer`, and the handle on it.

A spawned process with a KV cache of the `small` preset's layout (float32 unless asked for
another model dtype or an int8 cache) and a `TorchDistTransport`:
it issues tickets, waits like a decode engine (`worker.engine_thread`) and polls its
transport, and hosts the receiving end of the raw-gloo baseline. It reports to the benchmark
over a pipe, with `time.monotonic()` stamps (one clock for every process on a Linux host).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

import torch

from kvtransfer import rendezvous as rdv
from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import TransferTicket, blocks_needed, new_ticket
from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache

BLOCK = 16


def _decode_cache(model_dir: str, num_blocks: int, dtype: str, cache_dtype: str) -> KVCache:
    cfg = ModelConfig.from_model_dir(model_dir)
    name = Path(model_dir).name
    torch_dtype = getattr(torch, dtype)
    return KVCache(cfg, num_blocks, BLOCK, torch_dtype, model_name=name, cache_dtype=cache_dtype)


def _decode_main(
    conn: Connection, model_dir: str, num_blocks: int, dtype: str, cache_dtype: str
) -> None:
    """The decode worker: issues tickets, polls its transport, and hosts the raw-gloo receiver.

    Its loop waits like a decode engine's (`worker.engine_thread`): for a command or the
    transport's waker, at most 2 ms while a transfer is in flight, then polls the transport.
    """
    cache = _decode_cache(model_dir, num_blocks, dtype, cache_dtype)
    # Accepts both data planes: a sender that offers shared memory gets it, others gloo bytes.
    tr = TorchDistTransport(cache, "bench-d", connect_timeout_s=60.0, shared_memory=True)
    wake_r, wake_w = os.pipe()

    def wake() -> None:
        os.write(wake_w, b".")

    tr.set_waker(wake)
    conn.send(("ready", tr.endpoint.port))
    raw: rdv.PairGroup | None = None
    busy = False
    while True:
        ready = mp_wait([conn, wake_r], 0.002 if busy else 0.01)
        if wake_r in ready:
            os.read(wake_r, 4096)  # drained before polling: a later wake is not lost
        if conn in ready:
            cmd, arg = conn.recv()
            if cmd == "stop":
                tr.close()
                return
            if cmd == "expect":
                ids = list(range(blocks_needed(arg, BLOCK)))
                ticket = new_ticket(tr.endpoint, tr.layout, "bench", ids, arg, 60.0)
                tr.expect(ticket)
                busy = True
                conn.send(("ticket", ticket.to_dict()))
            elif cmd == "raw_join":
                store = rdv.connect_store("127.0.0.1", arg, 60.0)
                raw = rdv.make_pair_group(store, "raw", 0, 0, "gloo", "127.0.0.1", 60.0)
                conn.send(("raw_ready", 0))
            elif cmd == "raw_recv":
                assert raw is not None, "raw_join first"
                bufs = [torch.empty(arg, dtype=torch.float32) for _ in range(cache.num_layers)]
                works = [raw.recv([b], 1, 7) for b in bufs]
                conn.send(("raw_posted", 0))
                for w in works:
                    w.wait()
                conn.send(("raw_done", time.monotonic()))
        for res in tr.poll():
            busy = False
            conn.send(("result", {"ok": res.ok, "error": res.error, "t": time.monotonic()}))


class Decode:
    """The prefill side's handle on the decode process."""

    def __init__(
        self, model_dir: str, num_blocks: int, dtype: str = "float32", cache_dtype: str = "auto"
    ) -> None:
        """A decode process whose cache has `num_blocks` blocks of `model_dir`'s layout, for a
        model in `dtype`, stored as `cache_dtype` ("auto" | "int8")."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        args = (child, model_dir, num_blocks, dtype, cache_dtype)
        self.proc = ctx.Process(target=_decode_main, args=args)
        self.proc.start()
        self.port = int(self.wait("ready"))

    def wait(self, kind: str, timeout_s: float = 120.0) -> Any:
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"decode process sent no {kind!r} in {timeout_s} s")
        got, payload = self.conn.recv()
        if got != kind:
            raise RuntimeError(f"decode process sent {got!r} ({payload}), expected {kind!r}")
        return payload

    def ticket(self, num_tokens: int) -> TransferTicket:
        self.conn.send(("expect", num_tokens))
        return TransferTicket.from_dict(self.wait("ticket"))

    def stop(self) -> None:
        """Ask the decode process to exit; kill it if it does not (or is past listening)."""
        try:
            self.conn.send(("stop", None))
        except OSError as exc:  # it died already: the join below reaps it
            print(f"decode process gone before stop: {exc!r}", file=sys.stderr)
        self.proc.join(10.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)
