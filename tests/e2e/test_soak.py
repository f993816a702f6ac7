"""The short soak CI runs: `run_soak` (what `pdserve soak` runs) on a 2P+2D tiny-model cluster
with its own redis-server, about 300 requests and 8 overlapping faults (a prefill and a decode
worker SIGKILLed and restarted by the launcher, two SIGSTOPs, one SIGSTOP longer than every
request's deadline, a Redis restart, two KV stalls).
Every request must end exact, or with a clear status in time that the soak explains (a fault
on a worker it used, a role outage, its own deadline or cancel, a shed burst; the mix has
deadline storms, oversized HTTP bodies and HTTP disconnects) and never wait on the cluster longer
than the stall timeout plus a slack beyond its own work (`stalled`: a frozen worker held it), and
the cluster must end clean (no
leaked block, nothing in flight in the router, no stale Redis entry, restarted workers serving).

Runs in the pytest process; the soak starts and stops every process itself, by PID.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from deploy.tool_launchers import launch_workers
from tooling.redis_server import SKIP_REASON, redis_server_path
from tooling.soak.config import SoakConfig
from tooling.soak.run import run_soak

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(redis_server_path() is None, reason=SKIP_REASON),
]
CI_FAULTS = "kill-prefill:1,kill-decode:1,stop:2,long-stop:1,redis:1,kv-stall:2"


def test_short_soak_loses_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = SoakConfig(
        model=tiny_model_dir,
        out=tmp_path / "soak",
        requests=300,
        rate=5.0,
        seed=20,
        faults=CI_FAULTS,
        stop_max_s=4.0,
        default_timeout_s=15.0,
        long_stop_s=20.0,  # longer than any request's deadline
    )
    result = run_soak(config, launch_workers)
    s = result.summary
    detail = json.dumps({k: s[k] for k in ("failures", "examples", "faults")}, indent=1)
    assert s["passed"], detail
    bad = {k: s[k] for k in ("wrong", "hung", "stalled", "unclear", "leaked_blocks") if s[k]}
    assert not bad, detail
    assert s["requests"] >= 300 and len(s["faults"]) >= 8
    assert s["completed_exact"] + s["near_tie"] >= 150, s["ended_with_status"]
    assert s["ended_with_status"].get("RESOURCE_EXHAUSTED", 0) > 0, "the burst was not shed"
    kinds = {"kill-prefill", "kill-decode", "stop", "long-stop", "redis", "kv-stall"}
    assert {f["kind"] for f in s["faults"]} == kinds
    for name in ("soak.json", "requests.jsonl", "report.md", "timeline.png"):
        assert (config.out / name).is_file(), name
    assert json.loads((config.out / "soak.json").read_text())["passed"] is True
