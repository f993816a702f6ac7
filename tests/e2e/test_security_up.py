"""`pdserve up` with TLS and tokens as a real subprocess, and `pdserve generate` against it.

A public address without TLS and a token file is refused with the reason; with them, the
cluster serves `pdserve generate --tls-ca --auth-token-file` and refuses calls without the
token; neither the token nor the cluster secret appears in any log. Runs in the pytest
process; the cluster's processes are stopped by PID.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from deploy.processes import child_env, spawn, stop_processes, wait_for_lines
from security.secret import ENV_VAR, ClusterSecret
from tests.certs import mint

pytestmark = pytest.mark.slow
READY = re.compile(r"^pdserve ready: \S+:(\d+) \((\w+), (.*)\)$", re.M)
TOKEN = "e2e-token-9f2c"


def _pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "deploy.cli", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=child_env(1))


def test_a_public_address_needs_tls_and_a_token(tiny_model_dir: Path) -> None:
    done = _pdserve("up", "--no-ray", "--model", str(tiny_model_dir), "--host", "0.0.0.0")
    assert done.returncode == 2, done.stderr
    assert "router.host='0.0.0.0' is not a loopback address" in done.stderr
    assert "--insecure" in done.stderr and "pdserve ready" not in done.stdout


def test_up_with_tls_and_tokens_serves_generate(tiny_model_dir: Path, tmp_path: Path) -> None:
    certs = mint(tmp_path / "certs")
    tokens = tmp_path / "tokens"
    tokens.write_text(f"{TOKEN}\n")
    secret = ClusterSecret.generate()
    argv = [sys.executable, "-m", "deploy.cli", "up", "--no-ray", "--model", str(tiny_model_dir)]
    argv += ["--mode", "colocated", "--port", "0", "--host", "0.0.0.0"]
    argv += ["--tls-cert", str(certs.server_cert), "--tls-key", str(certs.server_key)]
    argv += ["--auth-token-file", str(tokens), "--log-dir", str(tmp_path / "workers")]
    up = spawn("pdserve-up", argv, tmp_path, {**child_env(1), **secret.env()})
    try:
        (m,) = wait_for_lines([up], READY, timeout_s=120)
        address = f"127.0.0.1:{m.group(1)}"
        ask = ["generate", "--addr", address, "--token-ids", "5,6,7", "--max-tokens", "4"]
        ask += ["--json", "--tls-ca", str(certs.ca)]
        ok = _pdserve(*ask, "--auth-token-file", str(tokens))
        assert ok.returncode == 0, ok.stderr
        assert '"finish_reason": "length"' in ok.stdout
        refused = _pdserve(*ask)
        assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
        up.popen.send_signal(signal.SIGTERM)
        assert up.popen.wait(timeout=30) == 0, up.tail()
    finally:
        stop_processes([up])
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.rglob("*.log"))
    assert "TLS, 1 bearer token(s); worker calls authenticated" in logs
    for secret_text in (TOKEN, secret.to_text(), secret.worker_token()):
        assert secret_text not in logs
    assert ENV_VAR not in " ".join(argv)
