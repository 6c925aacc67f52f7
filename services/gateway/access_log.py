"""The gateway's access log: one INFO line per HTTP request once its response has ended (a stream: after its
last byte), with what an operator needs and nothing of the content — method, path, status, and for generation
requests the request id, prompt / completion tokens, time to first token (streams only: a non-streamed answer
sends its first token with its last, so its line shows `ttft=-`) and duration. Never the prompt, the
output or the query string (tests/e2e/test_log_privacy.py). Probes and scrapes log at DEBUG only, so a kubelet
polling /ready does not drown the log. uvicorn's own access log stays off (app.py).

AccessLog is the outermost middleware, so it also stamps every request's `Arrival`: the gateway's TTFT and
duration are timed from it, as a client times them. For a connection's first request that is when its bytes
reached this host (http_protocol.py: the wait for a busy event loop to accept and read it counts); otherwise,
and for keep-alive follow-ups, ASGI entry (before the body is read or parsed)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger("kubesgl.gateway.access")

_QUIET_PATHS = frozenset({"/health", "/ready", "/metrics"})
# Where http_protocol.TimedHttpProtocol leaves the connection's FirstRequestArrival in every request's state.
FIRST_REQUEST_ARRIVAL = "first_request_arrival"


@dataclass(frozen=True)
class Arrival:
    """When the request reached the ASGI app: `perf_s` for durations, `unix_ns` for span start times."""

    perf_s: float
    unix_ns: int

    @staticmethod
    def now() -> Arrival:
        return Arrival(time.perf_counter(), time.time_ns())


def arrival_of(scope: Scope) -> Arrival:
    """The request's arrival as AccessLog stamped it (now, for an app mounted without AccessLog)."""
    arrival = scope.get("state", {}).get("arrival")
    return arrival if isinstance(arrival, Arrival) else Arrival.now()


@dataclass
class AccessRecord:
    """Filled in by a generation request's RequestScope; read by AccessLog when the response ends."""

    rid: str = "-"
    status: int | None = None  # how the request really ended (a stream's error status; 499: client gone)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_s: float | None = None  # None for a non-streamed answer (and a stream that sent no token)


def record_of(scope: Scope) -> AccessRecord:
    """The request's record, created on first use (RequestScope fills it through `request.state`)."""
    state = scope.setdefault("state", {})
    record = state.get("access")
    if record is None:
        record = state["access"] = AccessRecord()
    return record


class AccessLog:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})
        first = state.get(FIRST_REQUEST_ARRIVAL)
        arrival = (first.take() if first is not None else None) or Arrival.now()
        state["arrival"] = arrival
        sent: list[int] = []

        async def recording_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                sent.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, recording_send)
        finally:
            level = logging.DEBUG if scope["path"] in _QUIET_PATHS else logging.INFO
            if log.isEnabledFor(level):
                log.log(
                    level, "%s", line(scope, sent[0] if sent else None, time.perf_counter() - arrival.perf_s)
                )


def line(scope: Scope, http_status: int | None, duration_s: float) -> str:
    record: AccessRecord | None = scope.get("state", {}).get("access")
    status = str(http_status) if http_status is not None else "-"
    parts = [scope["method"], scope["path"], status]
    if record is not None:
        if record.status is not None and record.status != http_status:
            parts[-1] = f"{status} (ended {record.status})"  # e.g. a stream that ended with an error event
        ttft = "-" if record.ttft_s is None else f"{record.ttft_s:.3f}s"
        parts += [
            f"rid={record.rid}",
            f"prompt_tokens={record.prompt_tokens}",
            f"completion_tokens={record.completion_tokens}",
            f"ttft={ttft}",
        ]
    parts.append(f"duration={duration_s:.3f}s")
    return " ".join(parts)
