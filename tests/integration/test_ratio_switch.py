"""A real role switch made by the ratio controller under load drops nothing.

Runs in the pytest process: a tiny-model cluster of 1 prefill + 2 decode worker processes and
a router process (`tooling.planner.harness.start_cluster`), and in this process a sidecar
pool + `RatioController` (adaptive) acting through the real `PoolActuator` (Worker.SetRole).
While requests stream, the controller is fed TTFT misses, decides "decode -> prefill", drains
the least-loaded decode worker and switches it. Both decode workers are busy when it decides by
construction, not by speed: every decode worker holds its engine steps after a few
(`worker.step_gate`), and two "anchor" requests are sent one after the other: the second once
the first runs (held) on a decode worker, so the least-load policy puts it on the other; the
test waits on each state, and lets the workers step again once the controller has decided.
Checked: every request completes with all its tokens; the decision and its `done` record are
logged with their inputs; the pool and the worker report the new role; the router then
prefills on the switched worker; every worker's free KV blocks return to their totals.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from deploy.tool_launchers import launch_cluster
from model_runtime.config import ModelConfig
from proto.pdserve.v1 import worker_pb2
from proto.pdserve.v1.roles import ROLE_NAMES
from router.ratio.config import RatioConfig
from router.ratio.driver import RatioController
from tooling.goodput.records import RequestRecord, RequestSpec
from tooling.planner.harness import Sidecar, send_all, start_cluster
from worker.step_gate import hold, release

pytestmark = pytest.mark.slow

ANCHOR_TOKENS = 64  # held by the step gate until the decision: no length stands in for it
HELD_AFTER = 3  # steps a decode worker runs before it holds
# KV room for every request of the test in flight at once on one decode worker (2 anchors of
# 58 blocks + 60 loads of at most 6): on a slow or loaded machine the load piles up, and a
# refusal for KV room (RESOURCE_EXHAUSTED) would be overload, not a request the switch dropped.
ENGINE = {"block_size": 16, "num_kv_blocks": 512, "max_num_batched_tokens": 128, "max_num_seqs": 16}


def specs(n: int, rate: float, t0: float = 0.0) -> list[RequestSpec]:
    return [RequestSpec(i, t0 + i / rate, 24 + 8 * (i % 5), 40) for i in range(n)]


async def _scenario(model: Path, tmp: Path, hold_dir: Path) -> None:
    vocab = ModelConfig.from_model_dir(model).vocab_size
    cluster = start_cluster(model, 3, ENGINE, 1, tmp / "logs", launch_cluster)
    try:
        addresses = cluster.workers.addresses()
        roles = {a: r for r in ROLE_NAMES for a in addresses[r]}
        sc = Sidecar(roles, internal=cluster.workers.internal)
        await sc.start()
        config = RatioConfig(
            mode="adaptive",
            slo_ttft_ms=50,
            slo_tpot_ms=1000,
            min_requests=5,
            window_s=30,
            interval_s=1,
            cooldown_s=1,
            drain_timeout_s=30,
            decisions_path=tmp / "decisions.jsonl",
            # the decision rests on the fed TTFT misses alone, not on how long the queues
            # happen to be on this machine at this instant (a loaded CPU queues decode work)
            backlog=1e9,
            kv_high=1.0,
        )
        controller = RatioController(config, sc.pool, sc.actuator)
        loop = asyncio.get_running_loop()

        def anchor(i: int) -> asyncio.Task[tuple[list[RequestRecord], float]]:
            spec = [RequestSpec(i, 0.0, 24, ANCHOR_TOKENS)]
            return asyncio.create_task(send_all(cluster.address, spec, vocab, 5 + i, f"a{i}"))

        async def decode_busy(n: int) -> dict[str, int]:
            """Wait on the state: `n` decode workers hold running requests."""
            deadline = loop.time() + 60.0
            while True:
                await sc.pool.poll_once()
                busy = {v.address: v.num_running for v in sc.pool.views() if v.role == "decode"}
                if sum(1 for b in busy.values() if b) >= n:
                    return busy
                assert loop.time() < deadline, busy
                await asyncio.sleep(0.01)

        # every decode worker runs a few steps, then holds: an anchor seen running stays so
        await sc.pool.poll_once()
        decoders = [v for v in sc.pool.views() if v.role == "decode"]
        for v in decoders:
            st = await sc.pool.stub(v.address).GetStatus(worker_pb2.GetStatusRequest(), timeout=30)
            hold(hold_dir, st.worker_id, st.engine_steps + HELD_AFTER)
        # the second anchor is sent once the first runs: least-load then puts it on the other
        anchors = [anchor(0)]
        await decode_busy(1)
        anchors.append(anchor(1))
        load = asyncio.create_task(send_all(cluster.address, specs(60, 12.0), vocab, 3, "pre"))
        busy = await decode_busy(2)
        assert all(busy.values()), f"decode workers never all busy: {busy}"
        for _ in range(6):
            controller.observe(0.5, 0.01, True)  # TTFT misses (50 ms SLO), TPOT fine
        controller.sample()
        rec = await controller.evaluate()
        for v in decoders:  # decided: the held work may run (and the drain may end)
            release(hold_dir, v.worker_id)
        assert rec is not None and rec.action == "switch", rec
        assert (rec.from_role, rec.to_role) == ("decode", "prefill") and rec.applied
        mover = rec.address
        assert mover is not None
        await controller.wait_idle()
        records, _ = await load
        anchored = [r for task in anchors for r in (await task)[0]]
        records += anchored
        # nothing dropped: every request completed with every token
        bad = [(r.request_id, r.status, r.error) for r in records if not r.ok]
        assert not bad, bad
        done = controller.records[-1]
        assert done.event == "done" and done.decision_seq == rec.seq, done
        assert (done.prefill_workers, done.decode_workers) == (2, 1)
        assert sc.roles()[mover] == "prefill"
        stub = sc.pool.stub(mover)
        status = await stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=30)
        assert status.role == "prefill" and not status.draining
        # the router learns the role from its own poll and prefills on the mover
        mover_id = status.worker_id
        # (its poll interval is 0.25 s: wait on the state, a request prefilled on the mover)
        after: list[RequestRecord] = []
        deadline = asyncio.get_running_loop().time() + 60.0
        while not any(r.prefill_worker == mover_id for r in after):
            assert asyncio.get_running_loop().time() < deadline, {r.prefill_worker for r in after}
            batch, _ = await send_all(cluster.address, specs(8, 8.0), vocab, 4, "post")
            after += batch
        assert all(r.ok for r in after)
        assert all(r.decode_worker != mover_id for r in after)
        # the decision log holds the decision with its inputs, then its result
        lines = [json.loads(x) for x in (tmp / "decisions.jsonl").read_text().splitlines()]
        assert [x["event"] for x in lines] == ["decision", "done"]
        assert lines[0]["inputs"]["ttft_attainment"] == 0.0
        assert mover in {w["address"] for w in lines[0]["inputs"]["workers"]}
        # no leaks
        # (wait on the state, with a deadline far beyond a loaded machine's release time)
        deadline = loop.time() + 60.0
        while True:
            await sc.pool.poll_once()
            views = sc.pool.views()
            if all(v.free_blocks == v.total_blocks for v in views) or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
        assert all(v.free_blocks == v.total_blocks for v in views), views
        await sc.stop()
    finally:
        cluster.stop()


def test_controller_switch_under_load_drops_nothing(
    tiny_model_dir: Path, tmp_path: Path, hold_dir: Path
) -> None:
    asyncio.run(_scenario(tiny_model_dir, tmp_path, hold_dir))
