"""The gateway's request clock (AccessLog's Arrival) under its own HTTP protocol (http_protocol.py): a
connection's first request is timed from when its bytes reached the host, so a busy event loop's accept and
read wait counts; a keep-alive follow-up from its own arrival. Served by uvicorn in a thread of this process
(one clock for server and client), in front of a two-route ASGI app: /block holds the event loop, as a
saturated gateway's streaming work does; /probe answers its request's Arrival and when it entered ASGI."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import uvicorn
from kubesgl.runtime.listen import listen_socket
from kubesgl.services.gateway.access_log import AccessLog, arrival_of
from kubesgl.services.gateway.http_protocol import TimedHttpProtocol

BLOCK_S = 0.6
# tcpi_last_data_recv is kept in jiffies (4 ms at HZ=250, 10 ms at HZ=100) and reported in ms.
SLACK_S = 0.015


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    entered = time.perf_counter()
    if scope["path"] == "/block":
        blocking.set()
        time.sleep(BLOCK_S)  # in the event loop: nothing else on it runs meanwhile
    body = json.dumps({"arrival": arrival_of(scope).perf_s, "entered": entered}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


blocking = threading.Event()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    sock = listen_socket("127.0.0.1", 0)  # bound here: no other test can take the port before uvicorn runs
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        AccessLog(_app),
        http=TimedHttpProtocol,
        lifespan="off",
        log_level="warning",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, args=([sock],), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.01)
    yield port
    server.should_exit = True
    thread.join(5)


def _request(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode()


def _response(conn: socket.socket) -> dict[str, float]:
    data = b""
    while b"\r\n\r\n" not in data:
        data += conn.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(h for h in head.split(b"\r\n") if h.lower().startswith(b"content-length")).split(b":")[1]
    )
    while len(body) < length:
        body += conn.recv(65536)
    return json.loads(body)


def _block_the_loop(port: int) -> socket.socket:
    """Sends /block and returns once the server's event loop is held (for BLOCK_S)."""
    blocking.clear()
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(_request("/block"))
    assert blocking.wait(5)
    return conn


def test_a_new_connection_is_timed_from_its_bytes_arrival_not_its_late_asgi_entry(port: int) -> None:
    blocker = _block_the_loop(port)
    with socket.create_connection(("127.0.0.1", port)) as conn:  # the kernel accepts; the loop cannot yet
        connected = time.perf_counter()
        time.sleep(0.1)
        conn.sendall(_request("/probe"))
        sent = time.perf_counter()
        probe = _response(conn)
    _response(blocker)
    blocker.close()
    assert probe["entered"] - sent > 0.2  # the request did wait for the loop (most of BLOCK_S)
    if hasattr(socket, "TCP_INFO"):  # the kernel's receipt of the request: not its connect, not its accept
        assert connected + 0.1 - SLACK_S <= probe["arrival"] <= sent + SLACK_S, (connected, sent, probe)
    else:  # the connection's accept, before ASGI entry
        assert probe["arrival"] < probe["entered"]


def test_an_idle_connection_is_timed_from_when_its_request_arrives(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        time.sleep(0.3)  # connected (and accepted at once), then silent: a client's pre-opened connection
        sent = time.perf_counter()
        conn.sendall(_request("/probe"))
        probe = _response(conn)
    if hasattr(socket, "TCP_INFO"):
        assert sent - SLACK_S <= probe["arrival"] <= probe["entered"], (sent, probe)


def test_a_keep_alive_follow_up_is_timed_from_its_own_arrival(port: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.sendall(_request("/probe"))
        _response(conn)
        time.sleep(0.2)
        sent = time.perf_counter()
        conn.sendall(_request("/probe"))
        second = _response(conn)
    assert sent <= second["arrival"] <= second["entered"] + 1e-3, (sent, second)
