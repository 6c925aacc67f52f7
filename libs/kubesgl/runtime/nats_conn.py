"""Connecting a service to NATS: URL, credentials and TLS from flags/env, reconnecting forever with backoff.

A service never gives up on NATS: the first connect and every reconnect retry until the process is told to
stop, so a NATS restart (or NATS starting after the service, as in a fresh Kubernetes namespace) is survived.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client

log = logging.getLogger("kubesgl.nats")

DEFAULT_URL = "nats://127.0.0.1:4222"
# Reconnect backoff: doubling from the first delay up to the cap, with jitter so replicas do not stampede.
_BACKOFF_FIRST_S = 0.1
_BACKOFF_CAP_S = 2.0


@dataclass(frozen=True)
class NatsSettings:
    """Where and how to connect; secrets come from the environment (a Kubernetes Secret), never from flags."""

    urls: tuple[str, ...]
    user: str | None = None
    password: str | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    @classmethod
    def from_env(cls, url: str | None = None, env: dict[str, str] | None = None) -> NatsSettings:
        env = dict(os.environ) if env is None else env
        raw = url or env.get("KUBESGL_NATS_URL") or DEFAULT_URL
        return cls(
            urls=tuple(u.strip() for u in raw.split(",") if u.strip()),
            user=_secret(env, "KUBESGL_NATS_USER"),
            password=_secret(env, "KUBESGL_NATS_PASSWORD"),
            token=_secret(env, "KUBESGL_NATS_TOKEN"),
            tls_ca=env.get("KUBESGL_NATS_TLS_CA") or None,
            tls_cert=env.get("KUBESGL_NATS_TLS_CERT") or None,
            tls_key=env.get("KUBESGL_NATS_TLS_KEY") or None,
        )

    def tls_context(self) -> ssl.SSLContext | None:
        if not (self.tls_ca or self.tls_cert):
            return None
        ctx = ssl.create_default_context(cafile=self.tls_ca)
        if self.tls_cert:
            ctx.load_cert_chain(self.tls_cert, self.tls_key)
        return ctx


def _secret(env: dict[str, str], name: str) -> str | None:
    """`name`'s value, or the contents of the file `<name>_FILE` names (a mounted Secret: no credential in the
    process environment); one of the two, not both."""
    path = env.get(f"{name}_FILE")
    if not path:
        return env.get(name) or None
    if env.get(name):
        raise ValueError(f"{name} and {name}_FILE are both set; set one")
    with open(path) as f:
        return f.read().rstrip("\r\n") or None


def add_nats_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url",
        default=None,
        help=f"NATS server URL(s), comma-separated (env KUBESGL_NATS_URL, default {DEFAULT_URL}); "
        "credentials and TLS come from KUBESGL_NATS_USER/PASSWORD/TOKEN (or files named by their *_FILE "
        "variables) and KUBESGL_NATS_TLS_CA/CERT/KEY",
    )


class EagerClient(Client):
    """A client whose publishes reach the socket when they are made, not when its flusher task next runs.

    nats-py buffers a publish and wakes its flusher task, which asyncio runs after every task already ready.
    A gateway that has just read a burst of requests has one ready task per request, so the burst's first
    admission left only after the last one had been parsed: on the 2-core box, 128 requests reached the gateway
    within 25 ms and the first reached a tokenizer 220 ms later (`benchmark/serve_path.py`'s timeline). For a
    service that publishes once per request (the gateway, the tokenizer) the write per publish costs a send
    call, and the next hop starts on the first request while this one parses the rest.

    It relies on nats-py's buffer (`_pending`, `_pending_data_size`) and its transport (`_transport`); where a
    nats-py release changes them the client behaves as a plain one, which
    `test_eager_client_publishes_before_its_event_loop_turns` catches."""

    async def _send_command(self, cmd: bytes, priority: bool = False) -> None:
        await super()._send_command(cmd, priority)
        transport = getattr(self, "_transport", None)
        pending = getattr(self, "_pending", None)
        if not pending or transport is None or not self.is_connected:
            return  # connecting or reconnecting: nats-py sends the buffer once it is connected
        try:
            transport.writelines(pending)
        except OSError:
            return  # left buffered: the flusher meets the same error and reconnects
        self._pending = []
        self._pending_data_size = 0


async def connect(
    settings: NatsSettings, name: str, on_reconnect: Callable[[], None] | None = None, eager: bool = False
) -> Client:
    """A connected client that logs disconnects/reconnects and keeps reconnecting until closed;
    `on_reconnect` is called after each reconnect (e.g. to count it in metrics). `eager`: an EagerClient,
    for a service that publishes once per request."""

    async def on_error(e: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(e).__name__, e)

    async def on_disconnect() -> None:
        if not (nc.is_closed or nc.is_draining or nc.is_draining_pubs):  # a drain also ends in a disconnect
            log.warning("nats %s: disconnected; reconnecting", name)

    async def on_reconnected() -> None:
        log.info("nats %s: reconnected to %s", name, _netloc(nc))
        if on_reconnect is not None:
            on_reconnect()

    async def on_closed() -> None:
        log.info("nats %s: connection closed", name)

    nc = EagerClient() if eager else Client()
    options: dict[str, Any] = {
        "servers": list(settings.urls),
        "name": name,
        "error_cb": on_error,
        "disconnected_cb": on_disconnect,
        "reconnected_cb": on_reconnected,
        "closed_cb": on_closed,
        "allow_reconnect": True,
        "max_reconnect_attempts": -1,
        "reconnect_time_wait": _BACKOFF_CAP_S,
        "reconnect_to_server_handler": _backoff,
        "connect_timeout": 2,
        "ping_interval": 5,  # a dead server is noticed within ~10 s even without traffic
        "max_outstanding_pings": 2,
        "drain_timeout": 10,
        "tls": settings.tls_context(),
        "user": settings.user,
        "password": settings.password,
        "token": settings.token,
    }
    await nc.connect(**options)
    log.info("nats %s: connected to %s", name, _netloc(nc))
    return nc


async def close(nc: Client) -> None:
    """Drains (delivers what is buffered, then closes); a connection that is down is just closed."""
    if nc.is_closed:
        return
    try:
        await nc.drain()
    except Exception as e:  # reconnecting or already draining: nothing more can be flushed anyway
        log.info("nats drain skipped (%s); closing", type(e).__name__)
        await nc.close()


def _backoff(servers: list[Any], _info: dict[str, Any]) -> tuple[Any, float]:
    # nats-py counts failed attempts per server in `reconnects`; the least-tried server goes next.
    server = min(servers, key=lambda s: s.reconnects)
    delay = min(_BACKOFF_CAP_S, _BACKOFF_FIRST_S * 2 ** min(server.reconnects, 10))
    return server, delay * random.uniform(0.5, 1.0)


def _netloc(nc: Client) -> str:
    # hostname:port only: a URL's netloc may carry credentials.
    url = nc.connected_url
    return f"{url.hostname}:{url.port}" if url else "?"
