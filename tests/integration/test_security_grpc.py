"""TLS, mutual TLS and bearer tokens on the public API (gRPC and the OpenAI HTTP front); the
cluster secret on the worker API.

Real servers in this process: a prefill and a decode `WorkerServer` (tiny model) sharing a
cluster secret, and three routers over them on background event loops, each with its HTTP
front — plaintext, TLS + token file, mutual TLS + token file. Certificates are minted per
module (`tests.certs`).
Every test that touches workers ends with their free blocks back at the start.
"""

from __future__ import annotations

import asyncio
import json
import logging
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deploy.cli import main as pdserve
from deploy.client import CHANNEL_OPTIONS, build_request
from model_runtime.engine_config import EngineConfig
from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.app import RouterHandle, start_router
from router.config import RouterConfig
from security.channels import ClientSecurity, InternalAuth
from security.config import InternalTLS, SecurityConfig
from security.secret import ClusterSecret
from tests.certs import CertSet, mint
from worker.config import WorkerConfig
from worker.server import WorkerServer
from worker_main import server as worker_server

PROMPTS = [[5, 6, 7, 8, 9], [11, 3, 17, 40, 2, 8, 30], [21, 22]]
ENGINE = EngineConfig(block_size=8, num_kv_blocks=64, max_num_seqs=4)


class RouterThread:
    """`start_router` on an event loop of its own, so the tests can use sync clients."""

    def __init__(self, config: RouterConfig, secret: ClusterSecret | None) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        started = start_router(config, cluster_secret=secret)
        self.handle: RouterHandle = asyncio.run_coroutine_threadsafe(started, self.loop).result(60)

    @property
    def address(self) -> str:
        return self.handle.address

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.handle.stop(0.2), self.loop).result(15)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Cluster:
    certs: CertSet
    other: CertSet  # a different CA
    secret: ClusterSecret
    tokens: Path
    workers: dict[str, WorkerServer]
    plain: RouterThread
    tls: RouterThread
    mtls: RouterThread

    def client(self, **kw: object) -> ClientSecurity:
        fields: dict[str, object] = {"tls_ca": self.certs.ca, "auth_token_file": self.tokens}
        return ClientSecurity(**{**fields, **kw})  # type: ignore[arg-type]

    def status(self, address: str) -> worker_pb2.WorkerStatus:
        auth = InternalAuth(self.secret)
        with auth.channel(address, CHANNEL_OPTIONS) as ch:
            return auth.stub(worker_pb2_grpc.WorkerStub(ch)).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=5
            )

    def all_free(self) -> bool:
        return all(
            (s := self.status(w.address)).free_blocks == s.total_blocks
            for w in self.workers.values()
        )


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("security")
    certs, other = mint(tmp / "ca"), mint(tmp / "other-ca")
    secret = ClusterSecret.generate()
    tokens = _write(tmp / "tokens", "# rotated by hand\ntok-A\n")
    workers: dict[str, WorkerServer] = {}
    routers: list[RouterThread] = []
    try:
        for role in ("prefill", "decode"):
            cfg = WorkerConfig(model_dir=tiny_model_dir, role=role, engine=ENGINE)
            workers[role] = worker_server(cfg, secret)
            workers[role].start()
        base = RouterConfig(
            model_dir=tiny_model_dir,
            prefill_addrs=(workers["prefill"].address,),
            decode_addrs=(workers["decode"].address,),
            status_poll_interval_s=0.2,
            http_port=0,
        )
        tls = SecurityConfig(
            tls_cert=certs.server_cert,
            tls_key=certs.server_key,
            auth_token_file=tokens,
            token_reload_s=0.1,
        )
        mtls = tls.model_copy(update={"tls_client_ca": certs.ca})
        for security in (SecurityConfig(), tls, mtls):
            routers.append(RouterThread(base.model_copy(update={"security": security}), secret))
        yield Cluster(certs, other, secret, tokens, workers, *routers)
    finally:
        for r in routers:
            r.stop()
        for w in workers.values():
            w.stop(1.0)


def _tokens(channel: grpc.Channel, prompt: list[int]) -> list[int]:
    stub = inference_pb2_grpc.InferenceStub(channel)
    req = build_request(token_ids=prompt, max_tokens=6, temperature=0.0, ignore_eos=True)
    return [t for r in stub.Generate(req, timeout=30) for t in r.token_ids]


def _code(channel: grpc.Channel) -> grpc.StatusCode:
    """The status of a Generate call that must fail."""
    with pytest.raises(grpc.RpcError) as info:
        _tokens(channel, PROMPTS[0])
    return info.value.code()  # type: ignore[attr-defined,no-any-return]


def test_tls_refuses_plaintext_unknown_ca_and_mtls_without_a_client_cert(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.tls.address, CHANNEL_OPTIONS) as ch:
        assert _code(ch) == grpc.StatusCode.UNAVAILABLE  # no TLS handshake, no call
    with cluster.client(tls_ca=cluster.other.ca).channel(cluster.tls.address) as ch:
        assert _code(ch) == grpc.StatusCode.UNAVAILABLE  # the server's cert is not trusted
    with cluster.client().channel(cluster.mtls.address) as ch:
        assert _code(ch) == grpc.StatusCode.UNAVAILABLE  # mutual TLS: no client cert
    foreign = cluster.client(tls_cert=cluster.other.client_cert, tls_key=cluster.other.client_key)
    with foreign.channel(cluster.mtls.address) as ch:
        assert _code(ch) == grpc.StatusCode.UNAVAILABLE  # a client cert another CA signed
    ours = cluster.client(tls_cert=cluster.certs.client_cert, tls_key=cluster.certs.client_key)
    with ours.channel(cluster.mtls.address) as ch:
        assert len(_tokens(ch, PROMPTS[0])) == 6
    assert cluster.all_free()


def test_tokens_gate_calls_and_the_answers_equal_the_plaintext_clusters(
    cluster: Cluster, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with cluster.client(auth_token_file=None).channel(cluster.tls.address) as ch:
        assert _code(ch) == grpc.StatusCode.UNAUTHENTICATED
        info = inference_pb2_grpc.InferenceStub(ch).GetModelInfo
        with pytest.raises(grpc.RpcError) as err:
            info(inference_pb2.GetModelInfoRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes need no token
    wrong = _write(tmp_path / "wrong", "tok-a\n")  # case matters
    with cluster.client(auth_token_file=wrong).channel(cluster.tls.address) as ch:
        assert _code(ch) == grpc.StatusCode.UNAUTHENTICATED
    with (
        grpc.insecure_channel(cluster.plain.address, CHANNEL_OPTIONS) as plain,
        cluster.client().channel(cluster.tls.address) as secure,
    ):
        for prompt in PROMPTS:
            assert _tokens(secure, prompt) == _tokens(plain, prompt)
    # The same through `pdserve generate`'s flags.
    argv = ["generate", "--addr", cluster.tls.address, "--token-ids", "5,6,7,8,9"]
    argv += ["--max-tokens", "6", "--ignore-eos", "--json", "--tls-ca", str(cluster.certs.ca)]
    assert pdserve([*argv, "--auth-token-file", str(cluster.tokens)]) == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    with grpc.insecure_channel(cluster.plain.address, CHANNEL_OPTIONS) as plain:
        assert [t for x in lines for t in x["token_ids"]] == _tokens(plain, PROMPTS[0])
    assert pdserve(argv) == 1
    assert "UNAUTHENTICATED" in capsys.readouterr().err
    assert "tok-A" not in cluster.tls.handle.config.model_dump_json()
    assert cluster.all_free()


def test_a_rotated_token_file_takes_effect_at_run_time(
    cluster: Cluster, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    old, new = _write(tmp_path / "old", "tok-A\n"), _write(tmp_path / "new", "tok-B\n")

    def works(token_file: Path) -> bool:
        with cluster.client(auth_token_file=token_file).channel(cluster.tls.address) as ch:
            try:
                _tokens(ch, PROMPTS[2])
                return True
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
                return False

    assert works(old) and not works(new)
    _write(cluster.tokens, "tok-B\n")
    try:
        deadline = time.monotonic() + 5.0
        while not works(new):
            assert time.monotonic() < deadline, "the new token was never accepted"
            time.sleep(0.05)
        assert not works(old)
    finally:
        _write(cluster.tokens, "tok-A\n")
        deadline = time.monotonic() + 5.0
        while not works(old):
            assert time.monotonic() < deadline, "the restored token was never accepted"
            time.sleep(0.05)
    assert cluster.all_free()
    assert "token(s) in force" in caplog.text  # the reloads were logged, the tokens never
    for secret in ("tok-A", "tok-B", cluster.secret.to_text(), cluster.secret.worker_token()):
        assert secret not in caplog.text


WORKER_CALLS = ("GetStatus", "Reserve", "SetRole", "Abort", "GetKVSnapshot", "Generate")


def _worker_calls(stub: worker_pb2_grpc.WorkerStub) -> dict[str, grpc.StatusCode]:
    """Every state-changing (and the status) RPC of the worker API, called once."""
    calls = {
        "GetStatus": lambda: stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5),
        "Reserve": lambda: stub.Reserve(
            worker_pb2.ReserveRequest(request_id="r1", num_prompt_tokens=30, max_tokens=8),
            timeout=5,
        ),
        "SetRole": lambda: stub.SetRole(worker_pb2.SetRoleRequest(role="prefill"), timeout=5),
        "Abort": lambda: stub.Abort(worker_pb2.AbortRequest(request_id="r1"), timeout=5),
        "GetKVSnapshot": lambda: stub.GetKVSnapshot(worker_pb2.GetKVSnapshotRequest(), timeout=5),
        "Generate": lambda: list(
            stub.Generate(
                worker_pb2.WorkerGenerateRequest(request_id="g1", prompt_token_ids=[1, 2]),
                timeout=5,
            )
        ),
    }
    codes = {}
    for name, call in calls.items():
        with pytest.raises(grpc.RpcError) as info:
            call()
        codes[name] = info.value.code()  # type: ignore[attr-defined]
    return codes


def test_the_worker_api_answers_only_the_cluster_secret(cluster: Cluster) -> None:
    decode = cluster.workers["decode"]
    before = cluster.status(decode.address)
    denied = dict.fromkeys(WORKER_CALLS, grpc.StatusCode.UNAUTHENTICATED)
    for secret in (None, ClusterSecret.generate()):  # no secret, then another cluster's
        auth = InternalAuth(secret)
        with auth.channel(decode.address, CHANNEL_OPTIONS) as ch:
            assert _worker_calls(auth.stub(worker_pb2_grpc.WorkerStub(ch))) == denied
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    after = cluster.status(decode.address)
    assert (after.role, after.free_blocks, after.num_running) == (
        before.role,
        before.free_blocks,
        before.num_running,
    )
    assert after.free_blocks == after.total_blocks


def test_worker_mtls_needs_the_secret_too_and_routes_end_to_end(
    cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    internal = mint(tmp_path / "internal", "pdserve-internal")
    tls = InternalTLS(
        tls_cert=internal.server_cert, tls_key=internal.server_key, tls_ca=internal.ca
    )
    cfg = WorkerConfig(model_dir=tiny_model_dir, role="colocated", engine=ENGINE, internal_tls=tls)
    worker = worker_server(cfg, cluster.secret)
    worker.start()
    router = None
    try:
        with InternalAuth(None, tls).channel(worker.address, CHANNEL_OPTIONS) as ch:
            denied = _worker_calls(worker_pb2_grpc.WorkerStub(ch))  # a valid cert, no secret
            assert set(denied.values()) == {grpc.StatusCode.UNAUTHENTICATED}, denied
        with InternalAuth(cluster.secret).channel(worker.address, CHANNEL_OPTIONS) as ch:
            stub = InternalAuth(cluster.secret).stub(worker_pb2_grpc.WorkerStub(ch))
            with pytest.raises(grpc.RpcError) as info:  # the secret, but no TLS
                stub.GetStatus(worker_pb2.GetStatusRequest(), timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE  # type: ignore[attr-defined]
        ok = InternalAuth(cluster.secret, tls)
        with ok.channel(worker.address, CHANNEL_OPTIONS) as ch:
            status = ok.stub(worker_pb2_grpc.WorkerStub(ch)).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=5
            )
        assert (status.role, status.free_blocks) == ("colocated", status.total_blocks)
        config = RouterConfig(
            model_dir=tiny_model_dir,
            mode="colocated",
            colocated_addrs=(worker.address,),
            security=SecurityConfig(internal=tls),
        )
        router = RouterThread(config, cluster.secret)
        with (
            grpc.insecure_channel(router.address, CHANNEL_OPTIONS) as ch,
            grpc.insecure_channel(cluster.plain.address, CHANNEL_OPTIONS) as plain,
        ):
            assert _tokens(ch, PROMPTS[1]) == _tokens(plain, PROMPTS[1])
        with ok.channel(worker.address, CHANNEL_OPTIONS) as ch:
            status = ok.stub(worker_pb2_grpc.WorkerStub(ch)).GetStatus(
                worker_pb2.GetStatusRequest(), timeout=5
            )
        assert status.free_blocks == status.total_blocks
    finally:
        if router is not None:
            router.stop()
        worker.stop(1.0)


def _http(
    router: RouterThread,
    path: str,
    body: dict[str, object] | None = None,
    token: str | None = None,
    tls: ssl.SSLContext | None = None,
) -> tuple[int, dict[str, object]]:
    """(status, JSON body) of one request to `router`'s HTTP front (https when `tls`)."""
    front = router.handle.http
    assert front is not None
    scheme = "https" if tls is not None else "http"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{front.port}{path}", data=data)
    req.add_header("Content-Type", "application/json")
    if token is not None:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30, context=tls) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as err:
        raw, status = err.read(), err.code
    return status, (json.loads(raw) if raw.startswith(b"{") else {"raw": raw.decode()})


def test_the_http_front_takes_the_same_tls_and_tokens(cluster: Cluster) -> None:
    model = cluster.plain.handle.config.served_model_name
    completion = {"model": model, "prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0}
    trust = ssl.create_default_context(cafile=str(cluster.certs.ca))
    status, plain = _http(cluster.plain, "/v1/completions", completion)
    assert status == 200
    with pytest.raises(OSError):  # plaintext HTTP to the TLS port
        _http(cluster.tls, "/v1/completions", completion)
    with pytest.raises(OSError):  # a server certificate nobody here trusts
        _http(cluster.tls, "/health", tls=ssl.create_default_context(cafile=cluster.other.ca))
    status, body = _http(cluster.tls, "/v1/completions", completion, tls=trust)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    assert _http(cluster.tls, "/v1/completions", completion, "tok-a", trust)[0] == 401
    assert _http(cluster.tls, "/metrics", tls=trust)[0] == 401  # not --metrics-public
    assert _http(cluster.tls, "/health", tls=trust)[0] == 200  # probes need no token
    status, secure = _http(cluster.tls, "/v1/completions", completion, "tok-A", trust)
    assert status == 200
    assert secure["choices"][0]["text"] == plain["choices"][0]["text"]  # type: ignore[index]
    with pytest.raises(OSError):  # mutual TLS: no client certificate
        _http(cluster.mtls, "/v1/completions", completion, "tok-A", trust)
    mutual = ssl.create_default_context(cafile=str(cluster.certs.ca))
    mutual.load_cert_chain(cluster.certs.client_cert, cluster.certs.client_key)
    assert _http(cluster.mtls, "/v1/completions", completion, "tok-A", mutual)[0] == 200
    assert cluster.all_free()
