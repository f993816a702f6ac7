"""Security settings, token files, the cluster secret and the masking of credentials.

Pure and fast: files in tmp_path, no server.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from deploy.config import load_cluster_config
from router.config import RouterConfig
from router.prefix_index.config import RedisIndexConfig, mask_url, strip_password
from security.config import SecurityConfig, is_loopback
from security.grpc_auth import ClusterSecretInterceptor, with_metadata
from security.secret import ENV_VAR, ClusterSecret, resolve_cluster_secret
from security.tokens import TokenFile, bearer_token, parse_tokens
from worker.cli import parse_args as worker_args
from worker.config import WorkerConfig
from worker_main import server as worker_server


def test_loopback_addresses() -> None:
    for host in ("127.0.0.1", "127.9.9.9", "localhost", "::1", "[::1]"):
        assert is_loopback(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.4", "example.com", "[2001:db8::1]"):
        assert not is_loopback(host), host


def test_a_public_bind_needs_tls_and_a_token_unless_insecure(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    SecurityConfig().check_bind("127.0.0.1")
    with pytest.raises(ValueError) as err:
        SecurityConfig().check_bind("0.0.0.0")
    message = str(err.value)
    assert "router.host='0.0.0.0' is not a loopback address" in message
    assert "no TLS (" in message and "and no token file (" in message and "--insecure" in message
    with pytest.raises(ValueError, match="token file"):
        SecurityConfig(tls_cert=pem, tls_key=pem).check_bind("0.0.0.0")
    SecurityConfig(tls_cert=pem, tls_key=pem, auth_token_file=pem).check_bind("0.0.0.0")
    SecurityConfig(insecure=True).check_bind("0.0.0.0")
    with pytest.raises(ValidationError, match=re.escape("host='::'")):
        RouterConfig(model_dir=tmp_path, colocated_addrs=("h:1",), mode="colocated", host="::")
    public = {"model": "m", "router.host": "0.0.0.0"}
    with pytest.raises(ValidationError, match=r"router\.host"):
        load_cluster_config(None, public)
    cfg = load_cluster_config(None, {**public, "security.insecure": True})
    assert cfg.router_config({"prefill": ["h:1"], "decode": ["h:2"]}).security.insecure


def test_security_fields_go_in_pairs_and_missing_files_are_named(tmp_path: Path) -> None:
    pem = tmp_path / "x.pem"
    with pytest.raises(ValidationError, match=r"tls_cert and security\.tls_key"):
        SecurityConfig(tls_cert=pem)
    with pytest.raises(ValidationError, match="tls_client_ca"):
        SecurityConfig(tls_client_ca=pem)
    with pytest.raises(ValueError, match=r"security\.auth_token_file: .* is not a readable file"):
        SecurityConfig(auth_token_file=tmp_path / "missing").check_files()
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    SecurityConfig(tls_cert=pem, tls_key=pem, auth_token_file=pem).check_files()


def test_token_files_rotate_and_compare_every_token(tmp_path: Path) -> None:
    assert parse_tokens("# c\n  a  \n\nb\n") == ["a", "b"]
    assert bearer_token("Bearer abc") == "abc" and bearer_token(b"bearer  abc ") == "abc"
    assert bearer_token("Basic abc") is None and bearer_token("Bearer ") is None
    assert bearer_token(None) is None
    path = tmp_path / "tokens"
    path.write_text("one\ntwo\n")
    tokens = TokenFile(path)
    assert tokens.count == 2 and tokens.check("two") and not tokens.check("three")
    assert not tokens.check(None) and not tokens.check("")
    path.write_text("three\n")  # same size, maybe the same mtime: still seen
    assert tokens.reload_if_changed() and tokens.check("three") and not tokens.check("one")
    path.unlink()
    assert not tokens.reload_if_changed() and tokens.check("three")  # tokens in force stay
    with pytest.raises(ValueError, match=r"security\.auth_token_file"):
        TokenFile(tmp_path / "missing")


def test_the_cluster_secret_never_shows_and_needs_a_private_file(tmp_path: Path) -> None:
    secret = ClusterSecret.generate()
    assert secret.to_text() not in repr(secret) and secret.to_text() not in str(secret)
    keys = {secret.derive(p) for p in ("worker-grpc", "kv-records", "kv-offer")}
    assert len(keys) == 3 and secret.worker_token() == secret.derive("worker-grpc").hex()
    path = secret.write_file(tmp_path / "secret")
    assert (os.stat(path).st_mode & 0o777) == 0o600
    assert ClusterSecret.from_file(path) == secret
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="readable by group or others"):
        ClusterSecret.from_file(path)
    with pytest.raises(ValueError, match="at least 16 bytes"):
        ClusterSecret(b"short")
    env = {ENV_VAR: secret.to_text()}
    assert resolve_cluster_secret(None, env) == secret
    assert resolve_cluster_secret(None, {}) is None
    assert resolve_cluster_secret(None, {}, generate=True) is not None
    assert ClusterSecret.from_env(env, remove=True) == secret and ENV_VAR not in env


def test_the_worker_takes_its_secret_from_the_environment_and_removes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secret = ClusterSecret.generate()
    monkeypatch.setenv(ENV_VAR, secret.to_text())
    cfg, got = worker_args(["--model", str(tmp_path), "--role", "decode"])
    assert got == secret and ENV_VAR not in os.environ
    assert secret.to_text() not in cfg.model_dump_json()


def test_a_worker_refuses_a_public_host_without_the_secret(tmp_path: Path) -> None:
    cfg = WorkerConfig(model_dir=tmp_path, role="decode", host="0.0.0.0")
    with pytest.raises(ValueError, match="no cluster secret"):
        worker_server(cfg).start()  # refused before any model is loaded


def test_redis_passwords_are_masked_everywhere(tmp_path: Path) -> None:
    url = "redis://app:s3cret@10.0.0.9:6379/0"
    assert mask_url(url) == "redis://app:***@10.0.0.9:6379/0"
    assert strip_password(url) == "redis://app@10.0.0.9:6379/0"
    assert mask_url("redis://10.0.0.9:6379/0") == "redis://10.0.0.9:6379/0"
    assert strip_password("redis://:pw@h:1/0") == "redis://h:1/0"
    in_url = RedisIndexConfig(url=url)
    assert "s3cret" not in in_url.model_dump_json() and in_url.resolved_password() == "s3cret"
    field = RedisIndexConfig(url="redis://h:1/0", password=SecretStr("s3cret"))
    assert "s3cret" not in field.model_dump_json() and field.resolved_password() == "s3cret"
    pw_file = tmp_path / "pw"
    pw_file.write_text("s3cret\n")
    assert (
        RedisIndexConfig(url="redis://h:1", password_file=pw_file).resolved_password() == "s3cret"
    )
    with pytest.raises(ValidationError, match="give one Redis password"):
        RedisIndexConfig(url=url, password=SecretStr("x"))
    with pytest.raises(ValidationError, match="needs a rediss:// url"):
        RedisIndexConfig(url="redis://h:1", tls_ca_file=pw_file)
    cluster = load_cluster_config(
        None, {"model": "m", "router.prefix_index": {"kind": "redis", "url": url}}
    )
    assert "s3cret" not in cluster.model_dump_json()


def test_the_router_logs_no_credential(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from router.app import _config_for_log

    rc = RouterConfig(
        model_dir=tmp_path,
        mode="colocated",
        colocated_addrs=("h:1",),
        prefix_index=RedisIndexConfig(url="rediss://u:s3cret@h:1/0"),
    )
    with caplog.at_level(logging.DEBUG):
        logging.getLogger("test").info("config %s", _config_for_log(rc))
    assert "s3cret" not in caplog.text and "u:***@h:1" in caplog.text


def test_stub_metadata_is_added_to_every_call() -> None:
    seen: list[object] = []

    class Stub:
        def Call(
            self, request: object, timeout: float | None = None, metadata: object = None
        ) -> str:
            seen.append(metadata)
            return "ok"

    stub = with_metadata(Stub(), [("x-pdserve-cluster-auth", "abc")])
    assert stub.Call(1, timeout=2.0) == "ok"
    assert stub.Call(1, metadata=[("a", "b")]) == "ok"
    assert seen == [
        (("x-pdserve-cluster-auth", "abc"),),
        (("a", "b"), ("x-pdserve-cluster-auth", "abc")),
    ]
    check = ClusterSecretInterceptor("abc")
    assert check._allowed((("x-pdserve-cluster-auth", "abc"),))
    assert not check._allowed((("x-pdserve-cluster-auth", "abd"),)) and not check._allowed(None)


def test_the_router_document_carries_paths_and_the_environment_the_secrets(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from deploy.launcher import router_document, router_env, write_document
    from router.__main__ import parse_args as router_args
    from security.config import InternalTLS

    pem = tmp_path / "x.pem"
    security = SecurityConfig(
        tls_cert=pem,
        tls_key=pem,
        auth_token_file=pem,
        internal=InternalTLS(tls_cert=pem, tls_key=pem, tls_ca=pem),
    )
    rc = RouterConfig(
        model_dir=tmp_path,
        mode="colocated",
        colocated_addrs=("h:1",),
        host="0.0.0.0",
        security=security,
        prefix_index=RedisIndexConfig(url="rediss://u:s3cret@h:1/0", tls_ca_file=pem),
    )
    secret = ClusterSecret.generate()
    doc, env = router_document(rc), router_env(rc, secret)
    assert "s3cret" not in doc and secret.to_text() not in doc
    assert env == {**secret.env(), "PDSERVE_REDIS_PASSWORD": "s3cret"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    path = write_document(tmp_path, "router-0", doc)
    assert path.stat().st_mode & 0o777 == 0o600
    parsed = router_args(["--config", str(path)])
    assert parsed.security == security and parsed.host == "0.0.0.0"
    assert isinstance(parsed.prefix_index, RedisIndexConfig)
    assert parsed.prefix_index.resolved_password() == "s3cret"
    assert parsed.prefix_index.tls_ca_file == pem
    assert "PDSERVE_REDIS_PASSWORD" not in os.environ  # read once, then dropped


def test_http_requests_follow_the_same_rules(tmp_path: Path) -> None:
    from router.auth import PublicAuth
    from tests.certs import mint

    certs = mint(tmp_path / "ca")
    tokens = tmp_path / "tokens"
    tokens.write_text("t1\n")
    auth = PublicAuth(
        SecurityConfig(
            tls_cert=certs.server_cert,
            tls_key=certs.server_key,
            tls_client_ca=certs.ca,
            auth_token_file=tokens,
        )
    )
    assert auth.http_allowed("/health", None)
    assert not auth.http_allowed("/metrics", None) and auth.http_allowed("/metrics", "Bearer t1")
    assert not auth.http_allowed("/v1/completions", "Bearer t2")
    assert auth.http_allowed("/v1/completions", "bearer t1")
    ctx = auth.ssl_context()
    assert ctx is not None and ctx.verify_mode.name == "CERT_REQUIRED"
    public = PublicAuth(SecurityConfig(auth_token_file=tokens, metrics_public=True))
    assert public.http_allowed("/metrics", None) and public.ssl_context() is None
    assert PublicAuth(SecurityConfig()).http_allowed("/v1/models", None)
