"""An in-process OTLP trace receiver: the collector end of OpenTelemetry's protocol, over gRPC
(``TraceService/Export``) and HTTP/protobuf (``POST /v1/traces``), keeping every span it is
sent. Built on the `opentelemetry-proto` messages and services, as any collector is.

Used by the tests (one trace per request, checked span by span), the overhead benchmark (a
collector that answers, one that hangs: `hold()`), and by hand: ``python -m tracing.receiver``
listens on 127.0.0.1:4317 (gRPC) and :4318 (HTTP) and prints each trace as an indented tree
once it has been quiet for a second — a look at pdserve's traces without a tracing backend.

Runs in the process that starts it, on its own threads (a gRPC thread pool and an HTTP server
thread).
"""

from __future__ import annotations

import argparse
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

AttrValue = str | bool | int | float | tuple[Any, ...]


def _value(v: common_pb2.AnyValue) -> AttrValue:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return tuple(_value(x) for x in v.array_value.values)
    if kind is None:
        return ""
    out: AttrValue = getattr(v, kind)
    return out


def _attrs(kvs: Iterable[common_pb2.KeyValue]) -> dict[str, AttrValue]:
    return {kv.key: _value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as the collector got it (ids as hex; times in Unix nanoseconds)."""

    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    name: str
    kind: int  # opentelemetry.proto.trace.v1.Span.SpanKind
    start_ns: int
    end_ns: int
    attributes: dict[str, AttrValue]
    events: tuple[tuple[str, int, dict[str, AttrValue]], ...]  # (name, time, attributes)
    status_code: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, AttrValue] = field(default_factory=dict)

    @property
    def duration_ms(self) -> float:
        return (self.end_ns - self.start_ns) / 1e6


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> list[ReceivedSpan]:
    """Every span of one export request, flattened."""
    out = []
    for rs in request.resource_spans:
        resource = _attrs(rs.resource.attributes)
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    ReceivedSpan(
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes=_attrs(s.attributes),
                        events=tuple(
                            (e.name, e.time_unix_nano, _attrs(e.attributes)) for e in s.events
                        ),
                        status_code=s.status.code,
                        resource=resource,
                    )
                )
    return out


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """A running receiver (module docstring): `start()`, read `spans()` / `wait_for(...)`,
    `stop()`. `hold()` makes every export hang (a collector that accepts connections and never
    answers) until `release()`."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        grpc_port: int = 0,
        http_port: int = 0,
        on_spans: Callable[[list[ReceivedSpan]], None] | None = None,
    ) -> None:
        self._host = host
        self._lock = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._released = threading.Event()
        self._released.set()
        self._on_spans = on_spans
        self.exports = 0  # export calls answered
        self._pool = ThreadPoolExecutor(4, thread_name_prefix="otlp-receiver")
        self._grpc = grpc.server(self._pool)  # grpc never stops a pool it is given: `stop` does
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._grpc)  # type: ignore[no-untyped-call]
        self.grpc_port = self._grpc.add_insecure_port(f"{host}:{grpc_port}")
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                request = trace_service_pb2.ExportTraceServiceRequest.FromString(body)
                receiver._take(request)
                answer = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._http = ThreadingHTTPServer((host, http_port), Handler)
        self._http.daemon_threads = True
        self.http_port = self._http.server_address[1]
        self._http_thread = threading.Thread(
            target=self._http.serve_forever, name="otlp-receiver-http", daemon=True
        )

    @property
    def grpc_endpoint(self) -> str:
        return f"http://{self._host}:{self.grpc_port}"

    @property
    def http_endpoint(self) -> str:
        return f"http://{self._host}:{self.http_port}/v1/traces"

    def start(self) -> OtlpReceiver:
        self._grpc.start()
        self._http_thread.start()
        return self

    def stop(self) -> None:
        """Stop both servers and their threads (a held export is released first)."""
        self._released.set()
        self._grpc.stop(0).wait(5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._http.shutdown()
        self._http.server_close()

    def hold(self) -> None:
        """From now on every export waits (does not answer) until `release()`."""
        self._released.clear()

    def release(self) -> None:
        self._released.set()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self._take(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def _take(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        self._released.wait()
        spans = spans_of(request)
        with self._lock:
            self._spans += spans
            self.exports += 1
            self._lock.notify_all()
        if self._on_spans is not None:
            self._on_spans(spans)

    def spans(self) -> list[ReceivedSpan]:
        """Every span received so far, in arrival order."""
        with self._lock:
            return list(self._spans)

    def trace(self, trace_id: str) -> list[ReceivedSpan]:
        return [s for s in self.spans() if s.trace_id == trace_id]

    def wait_for(
        self, done: Callable[[list[ReceivedSpan]], bool], timeout_s: float, what: str
    ) -> list[ReceivedSpan]:
        """Wait until `done(spans so far)`; the spans then. TimeoutError naming `what`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not done(self._spans):
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({s.name for s in self._spans})
                    raise TimeoutError(f"no {what} within {timeout_s} s; spans so far: {names}")
                self._lock.wait(left)
            return list(self._spans)


def format_trace(spans: list[ReceivedSpan]) -> str:
    """One trace as an indented tree: offset from the trace's start, duration, span name, where
    it ran and its attributes (ids left out)."""
    if not spans:
        return ""
    t0 = min(s.start_ns for s in spans)
    children: dict[str, list[ReceivedSpan]] = {}
    ids = {s.span_id for s in spans}
    for s in sorted(spans, key=lambda s: s.start_ns):
        parent = s.parent_id if s.parent_id in ids else ""
        children.setdefault(parent, []).append(s)
    lines = [f"trace {spans[0].trace_id}"]

    def walk(parent: str, depth: int) -> None:
        for s in children.get(parent, []):
            where = s.resource.get("service.instance.id", "")
            attrs = ", ".join(
                f"{k}={v}" for k, v in sorted(s.attributes.items()) if not k.startswith("rpc.")
            )
            status = " ERROR" if s.status_code == 2 else ""
            lines.append(
                f"{(s.start_ns - t0) / 1e6:9.1f} ms {s.duration_ms:9.1f} ms  "
                f"{'  ' * depth}{s.name} [{where}]{status}  {attrs}"
            )
            for name, t, _ in s.events:
                lines.append(f"{(t - t0) / 1e6:9.1f} ms {'':12} {'  ' * depth}  * {name}")
            walk(s.span_id, depth + 1)

    walk("", 0)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """``python -m tracing.receiver``: print each trace once it has been quiet for
    `--quiet-s`."""
    parser = argparse.ArgumentParser(prog="python -m tracing.receiver", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--grpc-port", type=int, default=4317)
    parser.add_argument("--http-port", type=int, default=4318)
    parser.add_argument("--quiet-s", type=float, default=1.0)
    args = parser.parse_args(argv)
    receiver = OtlpReceiver(args.host, args.grpc_port, args.http_port).start()
    print(f"OTLP receiver: grpc {receiver.grpc_endpoint}, http {receiver.http_endpoint}")
    printed: set[str] = set()
    try:
        while True:
            time.sleep(args.quiet_s / 2)
            now = time.time_ns()
            by_trace: dict[str, list[ReceivedSpan]] = {}
            for s in receiver.spans():
                by_trace.setdefault(s.trace_id, []).append(s)
            for trace_id, spans in by_trace.items():
                last = max(s.end_ns for s in spans)
                if trace_id not in printed and now - last > args.quiet_s * 1e9:
                    printed.add(trace_id)
                    print(format_trace(spans), flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        receiver.stop()


if __name__ == "__main__":
    main()
