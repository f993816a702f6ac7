"""Where a KV transfer's fixed cost goes: per-stage timestamps on both sides of a transfer.

    python -m benchmarks.kvtransfer_stages --tokens 16 --reps 200

This process is the prefill worker, a spawned one the decode worker, each with a
`TorchDistTransport` over a cache of `--model`'s layout (bfloat16; no weights are loaded: the
KV bytes are whatever the cache holds). Each side waits as `worker.engine_thread` does (for the
transport's waker, at most 2 ms while a transfer is in flight) and polls. Each transfer is a
prompt's KV already in the cache, every layer handed over right after `open` (as
`bench_kv_int8 --parts transfer` does). The stages are stamped by wrapping the transport's own
functions (`install`) with `time.monotonic()` (one clock for every process on a Linux host);
each stage is reported as its median time from `open`, and the difference from the stage
before says where the time goes. `--no-stamps` runs the same loop unwrapped (for a profiler).

The wrapped functions are internals of `kvtransfer.dist_send` / `dist_recv`: a stage whose
function a change removes stops appearing. The pieces both sides share (`small_cache`,
`engine_wait`, `decode_loop`) also serve `benchmarks.kvtransfer_ab`.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing as mp
import os
import queue
import statistics
import time
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

import torch

from kvtransfer.torch_dist import TorchDistTransport
from kvtransfer.types import TransferTicket, blocks_needed
from model_runtime.config import ModelConfig
from model_runtime.kv_cache import KVCache

BLOCK = 16
STAMPS: list[tuple[str, float]] = []  # this process's stamps for the transfer in flight


def stamp(name: str) -> None:
    STAMPS.append((name, time.monotonic()))


def _wrap(owner: Any, attr: str, before: str | None, after: str | None) -> None:
    """Stamp `before` on entering `owner.attr`, `after` on leaving it (either may be None)."""
    fn = getattr(owner, attr)

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before:
            stamp(before)
        try:
            return fn(*args, **kwargs)
        finally:
            if after:
                stamp(after)

    setattr(owner, attr, wrapped)


class _StampedStore:
    """A sender's store client whose header push and pair check are stamped."""

    def __init__(self, store: Any) -> None:
        self._store = store

    def queue_push(self, key: str, value: str) -> None:
        stamp("s.header_push")
        self._store.queue_push(key, value)
        stamp("s.header_pushed")

    def get(self, key: str) -> bytes:
        stamp("s.check_start")
        try:
            return bytes(self._store.get(key))
        finally:
            stamp("s.check_done")


def install() -> None:
    """Wrap the transport's internals with stamps (both sides; each process stamps its own)."""
    from kvtransfer import dist_recv, dist_send, recv_stream, send_state, wire
    from kvtransfer import rendezvous as rdv

    _wrap(dist_send.Sender, "_run", "s.helper_running", None)
    _wrap(dist_send.Sender, "_post_layer", "s.post_layer", None)
    _wrap(dist_send.Sender, "_wait_layer", None, "s.wait_layer")
    _wrap(dist_send, "read_code", None, "s.ack_received")
    _wrap(rdv, "decode", None, "r.record_popped")
    _wrap(dist_recv.Receiver, "_post_receives", "r.posting", "r.posted")
    _wrap(dist_recv.Receiver, "_run_transfer", "r.helper_running", None)
    _wrap(dist_recv, "control_tensor", "r.ack_send", None)
    _wrap(recv_stream.Posted, "wait_next", None, "r.wait_next")
    _wrap(wire.EventQueue, "put", "event", None)
    connected = send_state.SendPair.connected

    def stamped(pair: send_state.SendPair) -> tuple[Any, Any]:
        store, group = connected(pair)
        return _StampedStore(store), group

    setattr(send_state.SendPair, "connected", stamped)  # noqa: B010 (mypy: a method)


def small_cache(model_dir: str, num_blocks: int, cache_dtype: str) -> KVCache:
    """A bfloat16 model's KV cache of `model_dir`'s layout (`cache_dtype` "auto" or "int8")."""
    return KVCache(
        ModelConfig.from_model_dir(model_dir), num_blocks, BLOCK, torch.bfloat16,
        model_name=Path(model_dir).name, cache_dtype=cache_dtype,
    )  # fmt: skip


class EngineWait:
    """Waits like an engine thread with a transfer in flight: for the transport's waker, at
    most 2 ms (`worker.engine_thread.TRANSFER_POLL_S`), then polls."""

    def __init__(self) -> None:
        self._woken: queue.SimpleQueue[None] = queue.SimpleQueue()

    def wake(self) -> None:
        self._woken.put(None)

    def until_result(self, poll: Callable[[], list[Any]]) -> tuple[Any, float]:
        """The first result `poll` returns, and when."""
        while True:
            with contextlib.suppress(queue.Empty):
                self._woken.get(timeout=0.002)
            out = poll()
            if out:
                return out[0], time.monotonic()


def decode_loop(
    conn: Connection,
    receivers: Mapping[Any, Any],
    new_ticket: Callable[[Any, int], Any],
    stamps: list[tuple[str, float]] | None = None,
) -> None:
    """The decode worker's loop over its transports (`receivers`, by key): ``("expect", (key,
    tokens))`` -> ``("ticket", dict)`` (blocks 0..), each result -> ``("result", (ok, when,
    stamps))``, ``("stop", None)`` ends it. Waits like a decode engine (`EngineWait`'s rule,
    on a pipe the transports' wakers write to)."""
    wake_r, wake_w = os.pipe()

    def wake() -> None:
        os.write(wake_w, b".")

    for t in receivers.values():
        t.set_waker(wake)
    conn.send(("ready", None))
    busy = False
    while True:
        ready = mp_wait([conn, wake_r], 0.002 if busy else 0.05)
        if wake_r in ready:
            os.read(wake_r, 4096)
        if conn in ready:
            cmd, arg = conn.recv()
            if cmd == "stop":
                for t in receivers.values():
                    t.close()
                return
            key, tokens = arg
            if stamps is not None:
                stamps.clear()
            ticket = new_ticket(receivers[key], tokens)
            receivers[key].expect(ticket)
            busy = True
            conn.send(("ticket", ticket.to_dict()))
        for t in receivers.values():
            for res in t.poll():
                busy = False
                when = time.monotonic()
                conn.send(("result", (res.ok, when, list(stamps or []))))


def transfer_once(
    conn: Connection, key: Any, sender: Any, tokens: int, engine: EngineWait, ticket_type: Any
) -> tuple[float, float, float, list[tuple[str, float]]]:
    """One transfer from `sender` (the prompt's KV in its blocks 0..) to `decode_loop`'s
    receiver `key`, every layer handed over right after `open`: (when `open` was called, when
    the decode side had its result, when this side had its own, the decode side's stamps).
    `ticket_type`: the sender's `TransferTicket` class."""
    conn.send(("expect", (key, tokens)))
    got, raw = conn.recv()
    assert got == "ticket", (got, raw)
    ticket = ticket_type.from_dict(raw)
    STAMPS.clear()
    t0 = time.monotonic()
    sender.open(ticket, list(range(ticket.num_blocks)))
    for layer in range(ticket.layout.num_layers):
        sender.send_layer(ticket.transfer_id, layer)
    res, sent = engine.until_result(sender.poll)
    got, (ok, received, far) = conn.recv()
    assert got == "result" and ok and res.ok, (got, ok, res)
    return t0, received, sent, far


def _ticket(t: TorchDistTransport, tokens: int) -> Any:
    from kvtransfer.types import new_ticket

    ids = list(range(blocks_needed(tokens, BLOCK)))
    return new_ticket(t.endpoint, t.layout, "stages", ids, tokens, 60.0)


def _decode_main(conn: Connection, model_dir: str, blocks: int, dtype: str, stamps: bool) -> None:
    if stamps:
        install()
    receiver = TorchDistTransport(small_cache(model_dir, blocks, dtype), "stages-d")
    decode_loop(conn, {"d": receiver}, _ticket, STAMPS)


def run(
    model_dir: str, tokens: int, reps: int, cache_dtype: str, stamps: bool = True
) -> dict[str, list[float]]:
    """Stage -> seconds from `open`, one per rep (sender stages `s.*`, receiver `r.*`)."""
    if stamps:
        install()
    blocks = blocks_needed(tokens, BLOCK) + 2
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    args = (child, model_dir, blocks, cache_dtype, stamps)
    proc = ctx.Process(target=_decode_main, args=args)
    proc.start()
    p = TorchDistTransport(small_cache(model_dir, blocks, cache_dtype), "stages-p", serve=False)
    engine = EngineWait()
    p.set_waker(engine.wake)
    out: dict[str, list[float]] = {}
    try:
        assert conn.recv()[0] == "ready"
        for rep in range(reps + 3):  # three to join and warm up
            t0, received, sent, far = transfer_once(conn, "d", p, tokens, engine, TransferTicket)
            if rep < 3:
                continue
            near = [*STAMPS, ("poll_result", sent)]
            for side, marks in (("s", near), ("r", [*far, ("poll_result", received)])):
                seen: dict[str, int] = {}
                for name, t in marks:
                    name = name if name.startswith(("s.", "r.")) else f"{side}.{name}"
                    seen[name] = seen.get(name, 0) + 1
                    key = name if seen[name] == 1 else f"{name}#{seen[name]}"
                    out.setdefault(key, []).append(t - t0)
    finally:
        conn.send(("stop", None))
        proc.join(10)
        if proc.is_alive():
            proc.kill()
        p.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="models/small-bf16", help="model folder (its config)")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--cache-dtype", default="auto", choices=["auto", "int8"])
    ap.add_argument("--no-stamps", action="store_true", help="the loop alone, for a profiler")
    args = ap.parse_args()
    began = time.monotonic()
    stages = run(args.model, args.tokens, args.reps, args.cache_dtype, not args.no_stamps)
    per = (time.monotonic() - began) / (args.reps + 3)
    rows = sorted(
        ((k, statistics.median(v), len(v)) for k, v in stages.items()), key=lambda r: r[1]
    )
    print(
        f"{args.tokens} tokens, {args.reps} reps ({per * 1e3:.2f} ms each, all in), load "
        f"{os.getloadavg()[0]:.1f}; median ms from open (+ since the stage before; n = reps "
        "that had the stage)"
    )
    last = 0.0
    for name, med, n in rows:
        print(f"  {name:24s} {med * 1e3:7.3f}  (+{(med - last) * 1e3:6.3f})  n={n}")
        last = med


if __name__ == "__main__":
    main()
