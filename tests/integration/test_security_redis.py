"""The Redis prefix index behind a password (`requirepass`) and over TLS (`rediss://`), with a
real redis-server; the router in this process over fake workers whose fake prefix caches
publish KV events. Wrong credentials: reported once, routing by load, no request fails."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from pydantic import SecretStr

from proto.pdserve.v1 import inference_pb2 as ipb
from router.prefix_index.base import IndexUnavailable, KVSnapshot
from router.prefix_index.config import RedisIndexConfig, make_index
from router.prefix_index.redis_index import RedisPrefixIndex
from tests.certs import mint
from tests.fakes.cluster import fake_cluster, wait_until
from tests.fakes.fake_worker import FakeWorkerConfig
from tooling.redis_server import SKIP_REASON, RedisServer, RedisTLS, redis_server_path

PASSWORD = "correct horse battery staple"
WRONG = "not-the-password-42"
PROMPT = list(range(10, 10 + 72))  # 4 full blocks of 16 + a tail: something to index
ROOMY = FakeWorkerConfig(total_blocks=1024)

pytestmark = pytest.mark.skipif(redis_server_path() is None, reason=SKIP_REASON)


@pytest.fixture
def protected(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", password=PASSWORD)
    server.start()
    try:
        yield server
    finally:
        server.stop()


async def _roundtrip(index: RedisPrefixIndex) -> list[int]:
    """Resync one worker's blocks, then match them: the blocks each match found."""
    await index.resync(KVSnapshot("w1", 7, 1, (11, 12, 13)))
    return [m.num_blocks for m in await index.match([11, 12, 13])]


def test_the_right_password_works_and_a_wrong_one_is_reported_once(
    protected: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        good = RedisPrefixIndex(protected.url, password=PASSWORD)
        none = RedisPrefixIndex(protected.url)
        bad = RedisPrefixIndex(protected.url, username="default", password=WRONG)
        try:
            assert await _roundtrip(good) == [3]
            for index in (none, bad):
                for _ in range(3):
                    with pytest.raises(IndexUnavailable, match="authentication failed"):
                        await index.match([11])
                assert index.auth_failures == 3
        finally:
            for index in (good, none, bad):
                await index.close()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    reports = [r for r in caplog.records if "rejected this router's credentials" in r.message]
    assert len(reports) == 2  # once per index, not once per call
    assert PASSWORD not in caplog.text and WRONG not in caplog.text


def test_wrong_credentials_fail_no_request(
    tiny_model_dir: Path, protected: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    async def scenario() -> None:
        for password, works in ((PASSWORD, True), (WRONG, False)):
            index = RedisIndexConfig(
                url=protected.url, password=SecretStr(password), heartbeat_s=0.2
            )
            async with fake_cluster(
                tiny_model_dir, n_prefill=2, n_decode=1, kv_blocks=256, worker=ROOMY,
                prefix_index=index,
            ) as c:  # fmt: skip
                req = ipb.GenerateRequest(
                    token_ids=ipb.TokenIds(ids=PROMPT),
                    sampling=ipb.SamplingParams(max_tokens=2, temperature=0.0),
                )
                failed: list[grpc.aio.AioRpcError] = []
                for _ in range(8):
                    try:
                        await c.generate(req)
                    except grpc.aio.AioRpcError as exc:
                        failed.append(exc)
                    await asyncio.sleep(0.05)
                assert failed == []
                stats = c.router.prefix_index.stats
                if works:
                    hits = lambda s=stats: s.lookup_hits > 0  # noqa: E731
                    await wait_until(hits, 5.0, "a prefix hit")
                else:
                    assert stats.lookup_hits == 0
                    assert stats.lookup_errors + stats.lookup_skipped == stats.lookups > 0
                await c.assert_no_leaks()

    with caplog.at_level(logging.INFO):
        asyncio.run(scenario())
    reports = [r for r in caplog.records if "rejected this router's credentials" in r.message]
    assert len(reports) == 1
    assert PASSWORD not in caplog.text and WRONG not in caplog.text


def test_rediss_with_the_servers_ca(tmp_path: Path) -> None:
    certs = mint(tmp_path / "ca", "localhost", "127.0.0.1")
    other = mint(tmp_path / "other", "localhost", "127.0.0.1")
    tls = RedisTLS(cert=certs.server_cert, key=certs.server_key, ca=certs.ca)
    server = RedisServer(tmp_path / "redis", password=PASSWORD, tls=tls)
    server.start()

    async def scenario() -> None:
        ok = make_index(
            RedisIndexConfig(url=server.url, password=SecretStr(PASSWORD), tls_ca_file=certs.ca)
        )
        untrusted = make_index(
            RedisIndexConfig(url=server.url, password=SecretStr(PASSWORD), tls_ca_file=other.ca)
        )
        plain = make_index(
            RedisIndexConfig(
                url=server.url.replace("rediss://", "redis://"), password=SecretStr(PASSWORD)
            )
        )
        try:
            assert isinstance(ok.index, RedisPrefixIndex)
            assert await _roundtrip(ok.index) == [3]
            for guarded in (untrusted, plain):  # a CA it does not trust; no TLS at all
                assert await guarded.lookup([11, 12, 13]) is None
                assert guarded.stats.lookup_errors + guarded.stats.lookup_timeouts == 1
        finally:
            for guarded in (ok, untrusted, plain):
                await guarded.close()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
