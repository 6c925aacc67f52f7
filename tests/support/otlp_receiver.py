"""An OTLP/HTTP trace receiver for tests: a real endpoint that decodes the exporters' protobuf requests.

Point a service at it with OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint; every span it receives is kept
as a ReceivedSpan for the test to inspect.
"""

from __future__ import annotations

import gzip
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str  # "" for a root span
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status_code: int  # 0 unset, 1 ok, 2 error


class OtlpReceiver:
    """Listens on 127.0.0.1 (free port) for POST /v1/traces; start() / stop(), or use as a context manager."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                encoding = self.headers.get("Content-Encoding", "")
                if encoding == "gzip":
                    body = gzip.decompress(body)
                elif encoding == "deflate":
                    body = zlib.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                req = ExportTraceServiceRequest()
                req.ParseFromString(body)
                receiver._add(req)
                out = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        # A short poll so stop() returns in ~50 ms rather than serve_forever's default 0.5 s.
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,), daemon=True)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def start(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def snapshot(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self.spans)

    def wait_for(
        self, predicate: Callable[[list[ReceivedSpan]], bool], timeout_s: float
    ) -> list[ReceivedSpan]:
        """Spans received once `predicate` holds for them; AssertionError with what came if it never does."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            spans = self.snapshot()
            if predicate(spans):
                return spans
            time.sleep(0.05)
        spans = self.snapshot()
        got = sorted({(s.service, s.name) for s in spans})
        raise AssertionError(f"spans never satisfied the condition within {timeout_s}s; received {got}")

    def _add(self, req: ExportTraceServiceRequest) -> None:
        spans = []
        for rs in req.resource_spans:
            resource = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    spans.append(
                        ReceivedSpan(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_span_id=s.parent_span_id.hex(),
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            attributes={kv.key: _value(kv.value) for kv in s.attributes},
                            status_code=s.status.code,
                        )
                    )
        with self._lock:
            self.spans.extend(spans)


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind) if kind else None
