"""`pdserve up` joining an existing multi-node Ray cluster made on this machine: a head node
(`ray start --head`) and a second node (`ray start --address ...`, its own resources), both
with their own temp dir and a token of their own. Checks: the workers land on both nodes and
report their node (Ray's node id) to the router; idle, every request's prefill/decode pair is
on one node; with one node's decode worker switched to prefill and the other node's prefill
worker to decode (each node holds one role only), every pair crosses nodes and that KV
moves as gloo bytes — the shared-memory plane is used only between workers whose node labels
match (both "nodes" share a host here, so only the labels keep them apart); greedy output
equals HF's throughout. Every Ray process started here is stopped by PID.

Runs in the pytest process (the Ray nodes and `pdserve up` are subprocesses; this process
joins the Ray cluster as a driver only to ask the worker actors which peers they share memory
with).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

ray = pytest.importorskip("ray", reason="ray not installed")
transformers = pytest.importorskip("transformers")

from deploy.client import build_request, stream_generate  # noqa: E402
from deploy.processes import child_env, spawn, wait_for_lines  # noqa: E402
from proto.pdserve.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402
from security.channels import InternalAuth  # noqa: E402
from security.secret import ClusterSecret  # noqa: E402

pytestmark = pytest.mark.slow
RAY = str(Path(sys.executable).with_name("ray"))
NEW_TOKENS = 6


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (ppid, command line) of every process now running (from /proc)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            args = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[-1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        out[int(entry.name)] = (ppid, args)
    return out


def _ours(marker: str) -> set[int]:
    """Processes whose command line names `marker` (our Ray temp dir), and their descendants."""
    table = _proc_table()
    found = {p for p, (_, a) in table.items() if marker in a and p != os.getpid()}
    todo = list(found)
    while todo:
        parent = todo.pop()
        for p, (pp, _) in table.items():
            if pp == parent and p not in found:
                found.add(p)
                todo.append(p)
    return found


def _stop(pids: set[int], grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for p in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p, sig)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
            time.sleep(0.2)


@pytest.fixture
def two_ray_nodes() -> Iterator[tuple[str, dict[str, str]]]:
    """(head address, env) of a 2-node Ray cluster on this machine, 2 CPUs per node."""
    tmp = tempfile.mkdtemp(prefix="pdray", dir="/tmp")  # short: Ray's socket paths are long
    # the nodes' workers import this checkout (child_env: PYTHONPATH), one thread each
    env = child_env(1) | {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    env.pop("RAY_ADDRESS", None)
    port = _free_port()
    common = ["--num-cpus", "2", "--object-store-memory", "100000000", "--disable-usage-stats"]
    head = [RAY, "start", "--head", "--port", str(port), "--temp-dir", tmp]
    head += ["--include-dashboard", "false", "--resources", '{"pdserve_node_a": 1}', *common]
    node = [RAY, "start", "--address", f"127.0.0.1:{port}"]
    node += ["--resources", '{"pdserve_node_b": 1}', *common]
    try:
        for argv in (head, node):
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stdout + done.stderr
        yield f"127.0.0.1:{port}", env
    finally:
        _stop(_ours(tmp))
        assert not _ours(tmp), "a Ray process of this test outlived it"


def env_token(env: dict[str, str]) -> dict[str, str]:
    """The Ray auth settings of `env` (what a process needs to join this test's cluster)."""
    return {k: env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")}


SECRET = ClusterSecret.generate()
"""The cluster secret `pdserve up` is given (by environment), so the test may call workers."""
AUTH = InternalAuth(SECRET)


def _status(address: str) -> worker_pb2.WorkerStatus:
    with AUTH.channel(address) as ch:
        stub = AUTH.stub(worker_pb2_grpc.WorkerStub(ch))  # type: ignore[no-untyped-call]
        return stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=10)


def _set_role(address: str, role: str) -> None:
    with AUTH.channel(address) as ch:
        stub = AUTH.stub(worker_pb2_grpc.WorkerStub(ch))  # type: ignore[no-untyped-call]
        stub.SetRole(worker_pb2.SetRoleRequest(role=role, drain_timeout_s=10), timeout=30)


def _healthy_by_role(metrics_url: str) -> dict[str, int]:
    """The router's `num_workers{state="healthy"}` per role, from its `/metrics`."""
    with urllib.request.urlopen(metrics_url, timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, int] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "pdserve:num_workers":
            for sample in family.samples:
                if sample.labels["state"] == "healthy":
                    out[sample.labels["role"]] = int(sample.value)
    return out


def _wait_router_roles(
    metrics_url: str, prefill: int, decode: int, timeout_s: float = 60.0
) -> None:
    """Poll the router's `/metrics` until it counts exactly these healthy workers per role."""
    want = {"prefill": prefill, "decode": decode, "colocated": 0}
    deadline = time.monotonic() + timeout_s
    while (seen := _healthy_by_role(metrics_url)) != want:
        assert time.monotonic() < deadline, f"the router's view {seen}, wanted {want}"
        time.sleep(0.1)


def _generate(router: str, prompt: list[int]) -> tuple[list[int], str, str]:
    req = build_request(token_ids=prompt, max_tokens=NEW_TOKENS, temperature=0.0)
    tokens, pair = [], ("", "")
    for r in stream_generate(router, req, 60):
        tokens += list(r.token_ids)
        if r.HasField("final"):
            pair = (r.final.prefill_worker, r.final.decode_worker)
    return tokens, *pair


_SHM_PEERS = """
import json, sys
import ray
ray.init(address=sys.argv[1], namespace="pdserve", log_to_driver=False)
out = {}
for name in ray.util.list_named_actors():
    actor = ray.get_actor(name, namespace="pdserve")
    out[name.split("-", 1)[1]] = ray.get(actor.kv_shared_memory_peers.remote(), timeout=30)
print(json.dumps(out))
"""


def _shm_peers(address: str, env: dict[str, str]) -> dict[str, list[str]]:
    """worker id -> the receivers it sends KV to through shared memory (asks the actors, from
    a driver process of its own: Ray reads its auth settings once, at import)."""
    done = subprocess.run(
        [sys.executable, "-c", _SHM_PEERS, address],
        env={**os.environ, **env_token(env)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    peers: dict[str, list[str]] = json.loads(done.stdout.strip().splitlines()[-1])
    return peers


@pytest.mark.timeout(900)  # the start may take 480 s on a loaded machine
def test_pdserve_up_on_two_ray_nodes_pairs_by_node(
    two_ray_nodes: tuple[str, dict[str, str]], tiny_model_dir: Path, tmp_path: Path
) -> None:
    address, env = two_ray_nodes
    hf = transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
               for n in (9, 17, 33, 24, 40, 12, 28, 19)]  # fmt: skip
    with torch.inference_mode():
        want = [
            hf.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                        do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            for p in prompts
        ]  # fmt: skip
    # Starting 4 actors on two raylets is the slow part on a loaded machine: give it the whole
    # budget of the wait below (the product default, 180 s, is for an unloaded cluster).
    config = tmp_path / "cluster.toml"
    config.write_text("[ray]\nstart_timeout_s = 480\n")
    argv = [sys.executable, "-m", "deploy.cli", "up", "--config", str(config)]
    argv += ["--model", str(tiny_model_dir)]
    argv += ["--mode", "disagg", "--prefill", "2", "--decode", "2", "--port", "0"]
    argv += ["--http-port", "0"]  # its /metrics: the router's view of the workers' roles
    argv += ["--torch-threads", "1", "--ray-address", address]
    up = spawn("pdserve-up-2nodes", argv, tmp_path, {**env, **SECRET.env()})
    try:
        pattern = re.compile(r"^pdserve ready: (\S+:\d+) \(disagg, 2 prefill: (\S+) (\S+), "
                             r"2 decode: (\S+) (\S+)\) http (\S+)/v1$", re.M)  # fmt: skip
        (m,) = wait_for_lines([up], pattern, 540)
        router, workers, metrics = m.group(1), m.groups()[1:5], f"{m.group(6)}/metrics"
        status = {a: _status(a) for a in workers}
        node = {s.worker_id: s.node for s in status.values()}
        nodes = {(s.node, s.role) for s in status.values()}
        assert len(set(node.values())) == 2 and all(node.values()), node
        assert len(nodes) == 4, f"each node should hold one prefill and one decode: {nodes}"
        # idle: every pair stays on one node
        for p, w in zip(prompts[:4], want[:4], strict=True):
            tokens, pre, dec = _generate(router, p)
            assert tokens == w and node[pre] == node[dec], (pre, dec, node)
        # node A holds only prefill workers, node B only decode workers: every pair crosses
        moved = next(a for a, s in status.items() if s.role == "decode")
        other = next(
            a for a, s in status.items() if s.role == "prefill" and s.node != status[moved].node
        )
        # The router learns roles from its status poll: wait until its view shows each switch
        # (3 prefill + 1 decode after the first tells the second's 2 + 2 from the start's).
        _set_role(moved, "prefill")
        _wait_router_roles(metrics, prefill=3, decode=1)
        _set_role(other, "decode")
        _wait_router_roles(metrics, prefill=2, decode=2)
        crossed = 0
        for p, w in zip(prompts[4:], want[4:], strict=True):
            tokens, pre, dec = _generate(router, p)
            assert tokens == w, (pre, dec)
            crossed += node[pre] != node[dec]
        assert crossed == len(prompts[4:])
        peers = _shm_peers(address, env)
        for sender, receivers in peers.items():
            assert all(node[r] == node[sender] for r in receivers), (sender, receivers, node)
        assert any(peers.values()), f"no same-node pair used shared memory: {peers}"
    finally:
        up.popen.send_signal(signal.SIGTERM)
        try:
            up.popen.wait(timeout=60)
        except subprocess.TimeoutExpired:
            up.popen.kill()
