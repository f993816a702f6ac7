"""`router.http.handlers.SSEWriter`: a client gone by the first write — the one that sends the
200 and its headers — or any later one is a client cancel (`asyncio.CancelledError`, the path
the lifecycle counts CANCELLED and aborts on), never an error the router reports INTERNAL.

aiohttp raises `ClientConnectionResetError` (a `ConnectionResetError`) when a response is
written to a closing transport; a payload writer that raises it stands in for that transport.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.client_exceptions import ClientConnectionResetError
from aiohttp.test_utils import make_mocked_request

from router.http.handlers import SSEWriter


class _GoneWriter:
    """A payload writer whose transport closed: every write fails as aiohttp's does."""

    def __init__(self, fail_headers: bool) -> None:
        self.fail_headers = fail_headers
        self.buffer_size = 0
        self.output_size = 0
        self.length: int | None = None
        self.chunked = False
        self.headers_written = False

    def enable_chunking(self) -> None:
        self.chunked = True

    def enable_compression(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def write_headers(self, status_line: str, headers: Any) -> None:
        if self.fail_headers:
            raise ClientConnectionResetError("Cannot write to closing transport")
        self.headers_written = True

    def send_headers(self, *args: Any, **kwargs: Any) -> None:
        if self.fail_headers:
            raise ClientConnectionResetError("Cannot write to closing transport")
        self.headers_written = True

    async def write(self, *args: Any, **kwargs: Any) -> None:
        raise ClientConnectionResetError("Cannot write to closing transport")

    async def drain(self) -> None:
        pass

    async def write_eof(self, *args: Any, **kwargs: Any) -> None:
        pass


@pytest.mark.parametrize("at_headers", [True, False], ids=["first-write", "later-write"])
def test_a_client_gone_at_a_write_is_a_cancel(at_headers: bool) -> None:
    async def scenario() -> None:
        request = make_mocked_request(
            "POST", "/v1/completions", writer=_GoneWriter(fail_headers=at_headers)
        )
        sse = SSEWriter(request)
        with pytest.raises(asyncio.CancelledError):
            await sse.send('{"id": "x"}')

    asyncio.run(scenario())
