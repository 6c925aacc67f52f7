"""nats_conn.EagerClient writes a publish to the socket when it is made: a subscriber gets it while the
publisher's event loop has not turned once since (nats-py's own flusher task never ran). A plain client's
publish waits for that turn. Against a real nats-server, the subscriber a raw protocol client on a thread."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest
from kubesgl.runtime.nats_conn import NatsSettings, close, connect
from kubesgl.runtime.nats_server import NatsServer

SUBJECT = "kubesgl.test.eager"


def _subscribe(host: str, port: int, ready: threading.Event, got: threading.Event) -> None:
    """A bare NATS subscriber: INFO, CONNECT + SUB + PING, then PONG means the subscription is in place."""
    with socket.create_connection((host, port), timeout=10) as s, s.makefile("rb") as f:
        f.readline()  # INFO
        s.sendall(
            b'CONNECT {"verbose":false,"pedantic":false}\r\nSUB ' + SUBJECT.encode() + b" 1\r\nPING\r\n"
        )
        while f.readline().strip() != b"PONG":
            pass
        ready.set()
        while line := f.readline():
            if line.startswith(b"MSG "):
                got.set()
                return
            if line.strip() == b"PING":
                s.sendall(b"PONG\r\n")


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "plain"])
def test_eager_client_publishes_before_its_event_loop_turns(nats_server: NatsServer, eager: bool) -> None:
    ready, got = threading.Event(), threading.Event()
    sub = threading.Thread(target=_subscribe, args=("127.0.0.1", nats_server.port, ready, got), daemon=True)
    sub.start()
    assert ready.wait(10), "the raw subscriber did not subscribe"

    async def publish_then_block() -> bool:
        nc = await connect(NatsSettings.from_env(nats_server.url), "eager-test", eager=eager)
        try:
            await nc.publish(SUBJECT, b"first")  # returns without suspending: no loop turn after it
            # The loop is blocked here: only a publish already on the socket can reach the subscriber.
            arrived = got.wait(5.0 if eager else 0.5)
        finally:
            await close(nc)
        return arrived

    assert asyncio.run(publish_then_block()) is eager
    if not eager:  # the plain client's flusher sends it at the loop's next turn (close drains it)
        assert got.wait(5.0)
    sub.join(5)
