"""A small synchronous client of the public `Inference` API, and `pdserve generate`.

Runs in the caller's process (the CLI, tests, scripts); it imports no torch. `build_request`
turns plain arguments into a `GenerateRequest`; `stream_generate` yields the server's
`GenerateResponse`s as they arrive and raises `grpc.RpcError` on failure (status code and
message from the router); `response_json` renders one response as a JSON-able dict.

`pdserve generate` streams the completion's text to stdout as it arrives (a summary line —
finish reason, token counts, TTFT — goes to stderr), or with `--json` one JSON object per
response: ``{"token_ids": [...], "text": "..."}`` and, on the last one, ``"finish_reason"``,
``"usage"``, ``"timings"`` and the workers that served it. A gRPC error prints
``pdserve generate: <STATUS_CODE>: <message>`` on stderr (plus a hint when nothing listens at
`--addr`) and exits 1; bad arguments exit 2; Ctrl-C cancels the call and exits 130.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Generator, Sequence
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from proto.pdserve.v1 import inference_pb2, inference_pb2_grpc
from security.cli import add_client_security_args, client_security

CHANNEL_OPTIONS = [("grpc.enable_http_proxy", 0)]


def build_request(
    *,
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    max_tokens: int | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    seed: int | None = None,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    ignore_eos: bool = False,
    request_id: str = "",
) -> inference_pb2.GenerateRequest:
    """A `GenerateRequest` with exactly one of `prompt` / `token_ids` (ValueError otherwise).
    Unset sampling values stay unset, so the router's defaults apply."""
    if (prompt is None) == (token_ids is None):
        raise ValueError("give exactly one of prompt (text) or token_ids")
    sampling = inference_pb2.SamplingParams(
        stop=list(stop), stop_token_ids=list(stop_token_ids), ignore_eos=ignore_eos
    )
    for name, value in (
        ("max_tokens", max_tokens),
        ("temperature", temperature),
        ("top_p", top_p),
        ("top_k", top_k),
        ("seed", seed),
    ):
        if value is not None:
            setattr(sampling, name, value)
    req = inference_pb2.GenerateRequest(request_id=request_id, sampling=sampling)
    if prompt is not None:
        req.text = prompt
    else:
        req.token_ids.ids.extend(token_ids or [])
    return req


def stream_generate(
    address: str,
    request: inference_pb2.GenerateRequest,
    timeout: float | None = None,
    channel: grpc.Channel | None = None,
) -> Generator[inference_pb2.GenerateResponse]:
    """Yield each response of one `Generate` call to the router at `address` (host:port).

    `timeout` is the request's deadline in seconds (None: the router's default). Raises
    `grpc.RpcError` (with `.code()` and `.details()`) when the call fails. Closing the generator
    early cancels the call. A `channel` given by the caller is used and left open.
    """
    own = channel is None
    ch = channel if channel is not None else grpc.insecure_channel(address, CHANNEL_OPTIONS)
    stub = inference_pb2_grpc.InferenceStub(ch)  # type: ignore[no-untyped-call]
    call = stub.Generate(request, timeout=timeout)
    try:
        yield from call
    finally:
        call.cancel()  # no-op once the stream ended; cancels it when the caller stops early
        if own:
            ch.close()


def response_json(resp: inference_pb2.GenerateResponse) -> dict[str, Any]:
    """One response as a dict: token_ids and text, plus the final info on the last one."""
    out: dict[str, Any] = {"token_ids": list(resp.token_ids), "text": resp.text}
    if resp.HasField("final"):
        final = MessageToDict(
            resp.final, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
        out["request_id"] = resp.request_id
        out.update(final)
    return out


# ---------------------------------------------------------------------- the CLI subcommand


def _token_ids(value: str) -> list[int]:
    try:
        ids = [int(x) for x in value.replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {value!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("--token-ids needs at least one id")
    return ids


def add_generate_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register `generate`: one streamed completion from a running cluster."""
    p = subparsers.add_parser(
        "generate",
        help="stream one completion from a running cluster",
        description="Send one Generate request to a pdserve router and stream the answer.",
    )
    p.add_argument("--addr", required=True, help="router host:port")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (tokenized by the router, with BOS)")
    src.add_argument("--token-ids", type=_token_ids, help="prompt token ids, e.g. 1,2,3")
    # Unset sampling values are not sent: the router's defaults (named here) apply.
    p.add_argument("--max-tokens", type=int, help="tokens to generate (default: the router's, 16)")
    p.add_argument("--temperature", type=float, help="0 = greedy (default: 0, greedy)")
    p.add_argument(
        "--top-p", type=float, help="nucleus sampling mass, in (0, 1] (default: 1.0, off)"
    )
    p.add_argument("--top-k", type=int, help="sample among the k likeliest, 0 = off (default: 0)")
    p.add_argument(
        "--seed", type=int, help="seed of this request's sampling (default: the engine's seed)"
    )
    p.add_argument(
        "--stop", nargs="+", action="extend", default=[], help="stop strings (default: none)"
    )
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    p.add_argument("--request-id", default="", help="request id (default: the router makes one)")
    p.add_argument(
        "--timeout", type=float, help="deadline in seconds (default: the router's default)"
    )
    p.add_argument("--json", action="store_true", help="one JSON object per response")
    add_client_security_args(p)
    p.set_defaults(func=generate_main)


def _no_server(details: str) -> bool:
    """True when a gRPC error's details say the connection itself failed (nothing listening,
    unknown host), as opposed to a router that answered UNAVAILABLE."""
    text = details.lower()
    return any(
        s in text for s in ("failed to connect", "connection refused", "dns resolution failed")
    )


def generate_main(args: argparse.Namespace) -> int:
    """Run `pdserve generate`; returns the exit code (0 ok, 1 gRPC error, 130 interrupted)."""
    req = build_request(
        prompt=args.prompt,
        token_ids=args.token_ids,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=args.stop,
        ignore_eos=args.ignore_eos,
        request_id=args.request_id,
    )
    try:
        channel = client_security(args).channel(args.addr, CHANNEL_OPTIONS)
    except ValueError as exc:  # an unreadable certificate or token file
        print(f"pdserve generate: {exc}", file=sys.stderr)
        return 2
    stream = stream_generate(args.addr, req, timeout=args.timeout, channel=channel)
    try:
        for resp in stream:
            if args.json:
                print(json.dumps(response_json(resp)), flush=True)
                continue
            sys.stdout.write(resp.text)
            sys.stdout.flush()
            if resp.HasField("final"):
                f = resp.final
                print()
                print(
                    f"[{f.finish_reason}] {f.usage.prompt_tokens} prompt tokens "
                    f"({f.usage.cached_tokens} cached), {f.usage.completion_tokens} generated; "
                    f"ttft {f.timings.ttft_ms:.1f} ms, e2e {f.timings.e2e_ms:.1f} ms",
                    file=sys.stderr,
                )
    except grpc.RpcError as exc:
        code = exc.code() if isinstance(exc, grpc.Call) else None
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        if not args.json:
            print()
        name = code.name if code is not None else "UNKNOWN"
        print(f"pdserve generate: {name}: {details}", file=sys.stderr)
        if code == grpc.StatusCode.UNAVAILABLE and _no_server(details or ""):
            print(
                f"pdserve generate: nothing answered at {args.addr}: is `pdserve up` running "
                f"there? (it prints 'pdserve ready: HOST:PORT' once it serves)",
                file=sys.stderr,
            )
        return 1
    except KeyboardInterrupt:
        stream.close()  # cancels the call
        print("\npdserve generate: interrupted", file=sys.stderr)
        return 130
    finally:
        channel.close()
    return 0
