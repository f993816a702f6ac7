"""The load generator's OpenAI-API side: one streaming `/v1/completions` call per request.

Runs in the load-generator process (`tooling.goodput.loadgen`, job `api="openai"`), against any
OpenAI-compatible server — another engine, or pdserve's own HTTP front. A request is sent as
vLLM, SGLang and pdserve all accept it: the prompt as token ids (exact input length), greedy,
``max_tokens`` = the spec's output length with ``ignore_eos`` (exact output length), streamed
with ``stream_options.include_usage``. What a record gets, on the client's clock:

- TTFT: send -> the first chunk with text; inter-token gaps between chunks with text
  (a server may put several tokens in one chunk; the gaps are per chunk);
- tokens: the final usage chunk's ``completion_tokens`` (chunks with text if the server sends
  no usage), so a record is OK only when every requested token arrived;
- an HTTP error's status becomes ``HTTP_<status>`` with the error object's message; an error
  event inside the stream ``STREAM_ERROR``; a request past its deadline ``DEADLINE_EXCEEDED``.

There are no server-side timings or worker names for these records; from pdserve's own HTTP
front the prefill path comes along (its ``pdserve`` extension on the finishing chunk).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp

from tooling.goodput.records import RequestRecord


def completion_body(model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """The JSON body of one benchmark request (module docstring)."""
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def list_models(url: str, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """`GET {url}/models`: the server's model cards (raises aiohttp.ClientError)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as s, s.get(f"{url}/models") as r:
        r.raise_for_status()
        data = await r.json()
    cards: list[dict[str, Any]] = data.get("data", [])
    return cards


def _error_message(text: str) -> str:
    try:
        return str(json.loads(text)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return text[:200]


async def consume_openai(
    session: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    rec: RequestRecord,
    t_sent: float,
    loop: asyncio.AbstractEventLoop,
    timeout_s: float,
) -> None:
    """Send one streaming completion and read it into `rec` (module docstring)."""
    first = prev = last = None
    text_chunks = 0
    usage_tokens: int | None = None
    try:
        async with asyncio.timeout(timeout_s):
            async with session.post(f"{url}/completions", json=body) as resp:
                if resp.status != 200:
                    rec.status = f"HTTP_{resp.status}"
                    rec.error = _error_message(await resp.text())
                else:
                    async for raw in resp.content:
                        line = raw.strip()
                        if not line.startswith(b"data:"):
                            continue
                        data = line[5:].strip()
                        now = last = loop.time()
                        if data == b"[DONE]":
                            break
                        chunk = json.loads(data)
                        if "error" in chunk:
                            rec.status = "STREAM_ERROR"
                            rec.error = str(chunk["error"].get("message", ""))
                            break
                        if chunk.get("usage"):
                            usage_tokens = int(chunk["usage"]["completion_tokens"])
                        if ext := chunk.get("pdserve"):  # pdserve's own HTTP front
                            rec.prefill_path = ext.get("prefill_path") or ""
                        for choice in chunk.get("choices") or ():
                            if choice.get("finish_reason"):
                                rec.finish_reason = choice["finish_reason"]
                            if choice.get("text"):
                                text_chunks += 1
                                if first is None:
                                    first = now
                                else:
                                    rec.itl_ms.append((now - prev) * 1e3)  # type: ignore[operator]
                                prev = now
    except TimeoutError:
        rec.status, rec.error = "DEADLINE_EXCEEDED", f"no end after {timeout_s} s"
    except aiohttp.ClientError as exc:
        rec.status, rec.error = "UNAVAILABLE", f"{type(exc).__name__}: {exc}"
    rec.num_tokens = usage_tokens if usage_tokens is not None else text_chunks
    rec.close(t_sent, first, prev, last if last is not None else loop.time())
