"""The admin HTTP endpoint of the bus services (tokenizer, detokenizer, scheduler): /health, /ready, /metrics.

Plain asyncio, no web framework: three GET routes for kubelet probes and Prometheus do not need one, and the
tokenizer/detokenizer/scheduler processes stay free of HTTP stacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from kubesgl.runtime.telemetry.metrics import render

log = logging.getLogger("kubesgl.admin")

_REQUEST_TIMEOUT_S = 5.0
_MAX_HEADER_BYTES = 16 << 10


class AdminServer:
    """Serves liveness (/health), readiness (/ready, from `ready()`) and Prometheus metrics (/metrics)."""

    def __init__(
        self,
        host: str,
        port: int,
        ready: Callable[[], bool],
        registry: CollectorRegistry,
        sock: socket.socket | None = None,
    ) -> None:
        self.host, self.port = host, port
        self._sock = sock  # an inherited listening socket (runtime/listen.py): serves there, not host:port
        self._ready = ready
        self._registry = registry
        self._server: asyncio.Server | None = None

    async def start(self) -> int:
        """Starts listening; returns the bound port (useful with port 0)."""
        if self._sock is not None:
            self._server = await asyncio.start_server(self._handle, sock=self._sock)
        else:
            self._server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        log.info("admin endpoint on http://%s:%d (/health /ready /metrics)", self.host, self.port)
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2.0)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), _REQUEST_TIMEOUT_S)
            if len(head) > _MAX_HEADER_BYTES:
                raise ValueError("headers too large")
            method, target = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")[:2]
            status, ctype, body = self._route(method, target.split("?", 1)[0])
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            status, ctype, body = 400, "text/plain", b"bad request\n"
        except ConnectionError:
            return
        reason = {
            200: "OK",
            400: "Bad Request",
            404: "Not Found",
            405: "Method Not Allowed",
            503: "Unavailable",
        }
        writer.write(
            f"HTTP/1.1 {status} {reason.get(status, '')}\r\nContent-Type: {ctype}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        if method != "GET":
            return 405, "text/plain", b"method not allowed\n"
        if path == "/health":
            return 200, "text/plain", b"ok\n"
        if path == "/ready":
            ok = self._ready()
            return (200 if ok else 503), "text/plain", b"ready\n" if ok else b"not ready\n"
        if path == "/metrics":
            body, ctype = render(self._registry)
            return 200, ctype, body
        return 404, "text/plain", b"not found\n"
