"""How a NATS-driven service process runs: admin endpoint first, NATS connect (forever, until told to stop),
start, wait for SIGTERM/SIGINT, drain, exit 0. Shared by the tokenizer, detokenizer and scheduler."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

from nats.aio.client import Client
from prometheus_client import CollectorRegistry

from kubesgl.runtime.admin_http import AdminServer
from kubesgl.runtime.lifecycle import configure_logging, stop_on_signals
from kubesgl.runtime.listen import inherited_socket_arg
from kubesgl.runtime.nats_conn import NatsSettings, add_nats_arguments, connect
from kubesgl.runtime.process import freeze_heap

log = logging.getLogger("kubesgl.runtime")


class BusService(Protocol):
    exit_code: int  # the process exit code once drained (non-zero after a fatal error)

    async def start(self) -> None: ...

    def ready(self) -> bool: ...

    def nats_reconnected(self) -> None:
        """Called after each NATS reconnect (metrics)."""
        ...

    async def drain(self, timeout_s: float) -> None:
        """Stop taking work, finish what was accepted within `timeout_s`, close the NATS connection."""
        ...


def add_service_arguments(parser: argparse.ArgumentParser, drain_timeout_s: float) -> None:
    """Flags every bus service shares: NATS, the admin endpoint, logging, the drain grace period."""
    add_nats_arguments(parser)
    parser.add_argument(
        "--admin-host", default="0.0.0.0", help="admin endpoint address (/health /ready /metrics)"
    )
    parser.add_argument(
        "--admin-port", type=int, default=9000, help="admin endpoint port (0 = any free port)"
    )
    parser.add_argument(
        "--admin-fd",
        dest="admin_socket",
        type=inherited_socket_arg,
        default=None,
        help="serve the admin endpoint on this inherited listening socket instead of --admin-host/--admin-port "
        "(how `kubesgl up` hands each service a port no other process can take meanwhile)",
    )
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=drain_timeout_s,
        help="seconds to finish accepted work after SIGTERM before exiting",
    )


def run_bus_service(
    args: argparse.Namespace,
    name: str,
    registry: CollectorRegistry,
    build: Callable[[Client, asyncio.Event], Awaitable[BusService]],
    eager: bool = False,
) -> int:
    """Runs the service to completion; returns the process exit code. `eager`: its NATS client writes each
    publish at once (nats_conn.EagerClient), for a service that publishes once per request."""
    configure_logging(args.log_level)
    with asyncio.Runner(loop_factory=event_loop_factory()) as runner:
        return runner.run(_serve(args, name, registry, build, eager))


def event_loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop where it is installed (the gateway's too: uvicorn picks it), else asyncio's. A bus service's
    loop mostly moves NATS bytes; uvloop's C transports take that off the interpreter."""
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


async def _serve(
    args: argparse.Namespace,
    name: str,
    registry: CollectorRegistry,
    build: Callable[[Client, asyncio.Event], Awaitable[BusService]],
    eager: bool,
) -> int:
    stop = stop_on_signals()
    service: BusService | None = None
    admin = AdminServer(
        args.admin_host,
        args.admin_port,
        lambda: service is not None and service.ready(),
        registry,
        args.admin_socket,
    )
    await admin.start()
    try:
        # Connecting retries forever (NATS may come up after us); a stop signal meanwhile ends the process.
        def reconnected() -> None:
            if service is not None:
                service.nats_reconnected()

        settings = NatsSettings.from_env(args.nats_url)
        connecting = asyncio.create_task(connect(settings, name, on_reconnect=reconnected, eager=eager))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({connecting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not connecting.done():
            connecting.cancel()
            return 0
        stopping.cancel()
        # The service may set `stop` itself, after a fatal error.
        service = await build(connecting.result(), stop)
        await service.start()
        freeze_heap()  # the service's process: its startup objects leave the collector's view
        log.info("%s started", name)
        await stop.wait()
        await service.drain(args.drain_timeout)
        log.info("%s stopped", name)
        return service.exit_code
    finally:
        await admin.stop()
