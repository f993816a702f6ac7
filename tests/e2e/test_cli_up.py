"""`pdserve up --no-ray` as a real subprocess: it prints its ready line, serves requests, and
on SIGTERM stops every process it started (the router runs inside it; its workers are
children it started by PID).

Runs in the pytest process.
"""

from __future__ import annotations

import json
import re
import signal
import sys
import urllib.request
from pathlib import Path

import pytest

from deploy.client import build_request, stream_generate
from deploy.processes import child_env, spawn, stop_processes, wait_for_lines
from tests.e2e.helpers import pid_alive, wait_until

pytestmark = pytest.mark.slow
READY = re.compile(r"^pdserve ready: (\S+:\d+) \((\w+), (.*)\)(?: http (\S+))?$", re.M)
STARTED = re.compile(r"started (worker-\S+) \(pid (\d+)\)")


def test_pdserve_up_no_ray_serves_and_stops_everything(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "deploy.cli", "up", "--no-ray", "--model", str(tiny_model_dir)]
    argv += ["--mode", "colocated", "--port", "0", "--http-port", "0"]
    argv += ["--log-dir", str(tmp_path / "workers")]
    up = spawn("pdserve-up", argv, tmp_path, child_env(1))
    try:
        (m,) = wait_for_lines([up], READY, timeout_s=120)
        address, mode = m.group(1), m.group(2)
        assert mode == "colocated" and "1 colocated: 127.0.0.1:" in m.group(3)
        log = up.log_text()
        # The config dumps are DEBUG: what comes before the ready line is a few short lines.
        before_ready = log[: log.index("pdserve ready:")]
        assert "effective config" not in log and "router config" not in log, before_ready
        assert len(before_ready) < 1000, before_ready
        workers = [int(pid) for _, pid in STARTED.findall(log)]
        assert len(workers) == 1 and all(pid_alive(p) for p in workers)

        req = build_request(token_ids=[5, 6, 7], max_tokens=4, temperature=0.0)
        tokens = [t for r in stream_generate(address, req, timeout=30) for t in r.token_ids]
        assert len(tokens) == 4

        http_url = m.group(4)  # the OpenAI API, from the same process
        body = {"model": tiny_model_dir.name, "prompt": [5, 6, 7], "max_tokens": 4}
        post = urllib.request.Request(
            f"{http_url}/completions", json.dumps({**body, "temperature": 0}).encode()
        )
        with urllib.request.urlopen(post, timeout=30) as resp:
            assert json.load(resp)["usage"]["completion_tokens"] == 4

        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(timeout=30) == 0, up.tail()
        wait_until(lambda: not any(pid_alive(p) for p in workers), 10.0, "workers to exit")
    finally:
        stop_processes([up])
