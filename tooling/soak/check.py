"""The soak's verdicts: each request against its reference, then the cluster after quiesce.
Runs in the soak process.

Per request (`judge`), one category:

- `exact`: OK, tokens, text and finish reason equal to the reference (`near_tie`: equal up to
  a numerical near-tie, see `reference`);
- `status`: ended with a clear status — DEADLINE_EXCEEDED, UNAVAILABLE, RESOURCE_EXHAUSTED, or
  CANCELLED by this client — and every token it got is the reference's (a prefix of it);
- `wrong`: a token (or the text, or the finish reason of an OK stream) differs from the
  reference, or an OK stream lost tokens;
- `hung`: still open `hang_grace_s` after its deadline (the client gave up on it), or ended
  later than that;
- `stalled`: its right tokens (all, or a prefix and a clear status) came, but it waited on the
  cluster longer than the stall budget (`SoakConfig.stall_budget_s`: the router's stall timeout
  plus a slack) beyond its own work (`client.longest_wait`): a frozen worker held it instead of
  the router moving it. Not judged for a request the client cancelled or gave its own deadline
  (it ends by that), which no budget could hold;
- `unclear`: any other status (INTERNAL, UNKNOWN, a CANCELLED the client did not ask for, ...);
- `refused`: an `oversized` request answered 400 naming ``messages[0].content`` within
  `OVERSIZED_MAX_S` (what it must get; anything else is `wrong`).

`blast.classify` then turns every `status` verdict into `explained` or `unexplained`.

The cluster (`cluster_checks`), once the load has ended: every killed worker served again with
a new epoch; every live worker's free blocks back to their start; the router's running, queued
and per-worker in-flight counts at 0; Redis holds no key or block field of a killed worker's old
epoch once its TTL has passed; and every restarted worker served a request after it rejoined.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tooling.soak.client import Outcome
from tooling.soak.cluster import SoakCluster
from tooling.soak.faults import FaultRecord
from tooling.soak.reference import Expected, Reference
from tooling.soak.workload import OVERSIZED_MAX_S, PlannedRequest

CLEAR_STATUSES = ("DEADLINE_EXCEEDED", "UNAVAILABLE", "RESOURCE_EXHAUSTED")


@dataclass(frozen=True)
class Verdict:
    index: int
    category: str  # exact | near_tie | refused | status | wrong | hung | unclear (+ blast's)
    detail: str = ""


def _first_diff(got: Sequence[int], want: Sequence[int]) -> int | None:
    return next((k for k, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), None)


def judge_oversized(r: PlannedRequest, out: Outcome) -> Verdict:
    """An oversized chat body: `refused` when answered as it must be (module docstring)."""
    if out.hung:
        return Verdict(r.index, "hung", f"open {out.latency_s:.2f} s")
    got = f"{out.code} naming {out.details!r} after {out.latency_s:.2f} s"
    named = out.code == "HTTP_400" and out.details == "messages[0].content"
    if named and out.latency_s <= OVERSIZED_MAX_S:
        return Verdict(r.index, "refused", got)
    return Verdict(r.index, "wrong", f"{got}; want HTTP_400 naming 'messages[0].content' "
                   f"within {OVERSIZED_MAX_S} s")  # fmt: skip


def judge(
    r: PlannedRequest,
    out: Outcome,
    want: Expected,
    ref: Reference,
    hang_grace_s: float,
    stall_budget_s: float | None = None,
) -> Verdict:
    """The category of one request (module docstring); `stall_budget_s` None: no `stalled`."""
    if out.hung or out.latency_s > out.deadline_s + hang_grace_s:
        return Verdict(r.index, "hung", f"open {out.latency_s:.2f} s, deadline {out.deadline_s}")
    got, exp = list(out.tokens), list(want.tokens)
    diff = _first_diff(got, exp)
    if diff is not None:
        if ref.is_near_tie(r, exp, got):
            return Verdict(r.index, "near_tie", f"first difference at token {diff}")
        return Verdict(
            r.index, "wrong", f"{out.code}: token {diff} is {got[diff]}, want {exp[diff]}"
        )
    if len(got) > len(exp):
        return Verdict(r.index, "wrong", f"{out.code}: {len(got)} tokens, want {len(exp)}")
    own_end = out.client_cancelled or r.timeout_s is not None
    if stall_budget_s is not None and not own_end and out.waited_s > stall_budget_s:
        return Verdict(
            r.index,
            "stalled",
            f"{out.code} after waiting {out.waited_s:.1f} s beyond its work "
            f"(budget {stall_budget_s:.1f} s)",
        )
    if out.code == "OK":
        if len(got) < len(exp):
            return Verdict(r.index, "wrong", f"OK with {len(got)} of {len(exp)} tokens")
        if out.text != want.text:
            return Verdict(r.index, "wrong", f"text {out.text!r}, want {want.text!r}")
        if out.finish_reason != want.finish_reason:
            return Verdict(
                r.index, "wrong", f"finish {out.finish_reason!r}, want {want.finish_reason!r}"
            )
        return Verdict(r.index, "exact")
    if out.code in CLEAR_STATUSES or (out.code == "CANCELLED" and out.client_cancelled):
        return Verdict(r.index, "status", out.code)
    return Verdict(r.index, "unclear", f"{out.code}: {out.details}")


# ------------------------------------------------------------------------------ the cluster


async def wait_rejoined(records: Sequence[FaultRecord], timeout_s: float) -> list[str]:
    """Wait (bounded) for every kill's rejoin watcher; the targets that never served again."""
    end = time.monotonic() + timeout_s
    kills = [r for r in records if r.kind.startswith("kill") and r.detail.startswith("SIGKILL")]
    while any(r.rejoined_s is None for r in kills) and time.monotonic() < end:
        await asyncio.sleep(0.25)
    return sorted({r.target for r in kills if r.rejoined_s is None})


async def leaked_blocks(
    cluster: SoakCluster, baseline: dict[str, int], timeout_s: float
) -> dict[str, int]:
    """Per worker id: blocks still missing from its start count once `timeout_s` passed
    (reservations and aborts settle asynchronously, so this waits for them). An unanswering
    worker is reported with -1."""
    end = time.monotonic() + timeout_s
    while True:
        missing: dict[str, int] = {}
        for w in cluster.refs():
            st = await cluster.status(w.address)
            held = -1 if st is None else baseline[w.worker_id] - st.free_blocks
            if held != 0:
                missing[w.worker_id] = held
        if not missing or time.monotonic() > end:
            return missing
        await asyncio.sleep(0.25)


async def router_in_flight(cluster: SoakCluster, timeout_s: float) -> dict[str, int]:
    """The router's in-flight counts once they reach 0, or as they are after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while True:
        counts = cluster.router_in_flight()
        if not any(counts.values()) or time.monotonic() > end:
            return counts
        await asyncio.sleep(0.1)


async def stale_index_entries(
    cluster: SoakCluster,
    records: Sequence[FaultRecord],
    ttl_s: float,
    t_now: float,
    settle_s: float = 15.0,
) -> list[str]:
    """Keys and block fields in Redis that still name a killed worker's old epoch once that
    worker's TTL has passed since the kill (waited for), polled for up to `settle_s` more (a
    restarted worker's indexer reconnects with a backoff before its resync clears them). One
    line per kind of leftover; [] when none is left."""
    old = {(r.target, str(r.old_epoch)) for r in records if r.kind.startswith("kill")}
    old = {(w, e) for w, e in old if e != "None"}
    last_kill = max((r.time_s for r in records if r.kind.startswith("kill")), default=None)
    if not old or last_kill is None:
        return []
    wait = last_kill + ttl_s + 1.0 - t_now
    if wait > 0:
        await asyncio.sleep(wait)
    end = time.monotonic() + settle_s
    while True:
        found = await _old_epoch_entries(cluster, old)
        if not found or time.monotonic() > end:
            return found
        await asyncio.sleep(0.5)


async def _old_epoch_entries(cluster: SoakCluster, old: set[tuple[str, str]]) -> list[str]:
    import redis.asyncio as aioredis

    assert cluster.workers is not None
    index = cluster.workers.router_config.prefix_index
    assert index.kind == "redis", index
    prefix = index.key_prefix.encode()
    found: dict[str, int] = {}
    # bytes, not str: block keys end in 16 raw hash bytes
    client = aioredis.Redis.from_url(cluster.redis.url, socket_timeout=5.0)
    try:
        async for key in client.scan_iter(match=prefix + b"w:*", count=1000):
            epoch = await client.hget(key, "epoch")
            wid = _text(key)[len(prefix) + 2 :]
            if epoch is not None and (wid, _text(epoch)) in old:
                found[f"worker key of {wid} at its old epoch"] = 1
        async for key in client.scan_iter(match=prefix + b"b:*", count=1000):
            fields = await client.hgetall(key)
            for w, e in fields.items():
                wid, ep = _text(w), _text(e)
                if (wid, ep) in old:
                    name = f"block fields of {wid} at its old epoch"
                    found[name] = found.get(name, 0) + 1
    finally:
        await client.aclose()
    return [f"{n} x {what}" for what, n in sorted(found.items())]


def _text(value: bytes | str) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def served_after_rejoin(
    records: Sequence[FaultRecord], outcomes: Sequence[Outcome], verdicts: Sequence[Verdict]
) -> list[str]:
    """Restarted workers with no exact request that started after their (last) rejoin."""
    ok = {v.index for v in verdicts if v.category in ("exact", "near_tie")}
    last: dict[str, float] = {}
    for r in records:
        if r.rejoined_s is not None:
            last[r.target] = max(last.get(r.target, 0.0), r.rejoined_s)
    missing = []
    for worker, t in sorted(last.items()):
        if not any(
            o.index in ok and o.sent_at >= t and worker in (o.prefill_worker, o.decode_worker)
            for o in outcomes
        ):
            missing.append(worker)
    return missing


def summarize_router(counts: dict[str, int]) -> dict[str, Any]:
    return {**counts, "total": sum(counts.values())}
