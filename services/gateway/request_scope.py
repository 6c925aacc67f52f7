"""What one HTTP generation request holds until its response ends (its concurrency lease, metrics timer and
trace span), released exactly once whichever way the response ends; at the end it fills the request's
access-log record (access_log.py). Timer and span start at the request's arrival (ASGI entry), not here: the
body's read and parse before the route runs is part of what the client waits for its first token."""

from __future__ import annotations

from fastapi import Request
from kubesgl.runtime.telemetry.tracing import ATTR_MODEL, ATTR_TTFT, SPAN_GATEWAY_REQUEST, traceparent
from kubesgl.services.gateway.access_log import arrival_of, record_of
from kubesgl.services.gateway.api_keys import ANONYMOUS
from kubesgl.services.gateway.gateway import Gateway
from opentelemetry.trace import SpanKind, Status, StatusCode

# nginx's "client closed request": the client left before the answer.
CLIENT_CLOSED = 499


class RequestScope:
    def __init__(self, gw: Gateway, request: Request, endpoint: str, model: str | None) -> None:
        key = getattr(request.state, "api_key", ANONYMOUS)
        self._lease = gw.limit.acquire(key)  # 429 before any work
        label = gw.metrics_model(model)
        arrival = arrival_of(request.scope)
        self.metrics = gw.metrics.request(label, endpoint, start=arrival.perf_s)
        self._span = gw.tracing.start_span(
            SPAN_GATEWAY_REQUEST,
            parent=request.headers,  # a Mapping: read for the trace context only, not copied
            attributes={ATTR_MODEL: label, "http.route": endpoint},
            kind=SpanKind.SERVER,
            start_time_ns=arrival.unix_ns,
        )
        self.traceparent = traceparent(self._span)
        self._access = record_of(request.scope)
        self._open = True

    def finish(self, status: int, rid: str | None = None, prompt_tokens: int = 0) -> None:
        """Ends the request with `status`; `rid` and `prompt_tokens` once it was fanned out (for the log)."""
        if not self._open:
            return
        self._open = False
        self._lease.release()
        self.metrics.finish(status)
        self._access.status, self._access.prompt_tokens = status, prompt_tokens
        self._access.rid = rid or "-"
        self._access.completion_tokens, self._access.ttft_s = self.metrics.tokens, self.metrics.ttft_s
        self._span.set_attribute("http.response.status_code", status)
        if self.metrics.ttft_s is not None:
            self._span.set_attribute(ATTR_TTFT, self.metrics.ttft_s)
        if status >= 500:
            self._span.set_status(Status(StatusCode.ERROR))
        self._span.end()
