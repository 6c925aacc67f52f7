"""A lean streaming client for the serving benchmarks: one POST per fresh asyncio connection (HTTP/1.1,
chunked or sized body), its Server-Sent Events' `data:` payloads yielded as they arrive.

Why not httpx: under a burst its connection pool costs the client about a millisecond per request before the
request leaves (measured on the CPU stack: +105 ms mean TTFT at 128 concurrent streams, +3.1 s with the pool
warmed first), time a benchmark would charge to the server. This client sends each request as soon as its
connection opens, so what it measures is the server's.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit


class HttpStatusError(Exception):
    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:200]}")
        self.status, self.body = status, body


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


def _split(base_url: str) -> SplitResult:
    url = urlsplit(base_url)
    if url.scheme != "http" or url.hostname is None:
        raise ValueError(f"only http:// URLs are supported, got {base_url!r}")
    return url


async def connect(base_url: str) -> Connection:
    """An open connection to `base_url`'s server, for post_events to write its request on later: a burst whose
    connections are all open before its first request is written (a client's warm connections) sends its
    requests together, without one event loop's 256 connects between the first and the last."""
    url = _split(base_url)
    return await asyncio.open_connection(url.hostname, url.port or 80)


async def post_events(
    base_url: str,
    path: str,
    body: Mapping[str, Any] | bytes,
    headers: Mapping[str, str] | None = None,
    on_sent: Callable[[], None] | None = None,
    connection: Connection | None = None,
) -> AsyncIterator[str]:
    """POSTs `body` as JSON (or `body` itself, already JSON-encoded bytes) and yields each SSE `data:` payload;
    `on_sent` runs once the request is written. `connection`: one from connect() to write it on (it is closed
    after), else a fresh one. A status other than 200 raises HttpStatusError with the response body."""
    url = _split(base_url)
    reader, writer = connection or await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        payload = body if isinstance(body, bytes) else json.dumps(body).encode()
        lines = [
            f"POST {url.path.rstrip('/')}{path} HTTP/1.1",
            f"Host: {url.netloc}",
            "Content-Type: application/json",
            f"Content-Length: {len(payload)}",
            "Connection: close",
            *(f"{k}: {v}" for k, v in (headers or {}).items()),
        ]
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + payload)
        await writer.drain()
        if on_sent is not None:
            on_sent()
        status = int((await reader.readline()).split()[1])
        response_headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            response_headers[key.strip().lower()] = value.strip()
        if response_headers.get("transfer-encoding", "").lower() == "chunked":
            pieces = _chunked(reader)
        else:
            pieces = _sized(reader, int(response_headers.get("content-length", "-1")))
        if status != 200:
            raise HttpStatusError(status, b"".join([p async for p in pieces]).decode(errors="replace"))
        buffer = b""
        async for piece in pieces:
            buffer += piece
            *complete, buffer = buffer.split(b"\n")
            for event_line in complete:
                if event_line.startswith(b"data: "):
                    yield event_line[6:].rstrip(b"\r").decode()
    finally:
        writer.close()


async def _chunked(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        yield await reader.readexactly(size)
        await reader.readexactly(2)  # the chunk's CRLF


async def _sized(reader: asyncio.StreamReader, length: int) -> AsyncIterator[bytes]:
    if length < 0:  # no length: the body runs until the server closes
        while piece := await reader.read(65536):
            yield piece
    elif length > 0:
        yield await reader.readexactly(length)
