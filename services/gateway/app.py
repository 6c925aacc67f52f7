"""`kubesgl gateway`: builds the FastAPI app (routes, error handlers, guards) around one NATS connection and
runs it under uvicorn, in this process or in --workers processes on one port (workers.py). `add_arguments`/`main`
are what `kubesgl.cli` calls."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import socket
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kubesgl import __version__
from kubesgl.errors import InvalidRequestError, KubesglError, ServiceUnavailableError
from kubesgl.openai_api.http_errors import error_body, error_from_validation
from kubesgl.routing import SchedulerRegistry
from kubesgl.runtime.nats_conn import NatsSettings, connect
from kubesgl.runtime.process import freeze_heap, parent_death_signal
from kubesgl.runtime.telemetry.metrics import GatewayMetrics, multiprocess_registry, new_registry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.gateway import native_routes, openai_routes, ops_routes
from kubesgl.services.gateway.access_log import AccessLog, arrival_of
from kubesgl.services.gateway.api_keys import ApiKeys
from kubesgl.services.gateway.bus import GatewayBus
from kubesgl.services.gateway.config import GatewayConfig, config_from_args
from kubesgl.services.gateway.config import add_arguments as add_config_arguments
from kubesgl.services.gateway.gateway import Gateway
from kubesgl.services.gateway.guards import ApiKeyCheck, BodySizeLimit
from kubesgl.services.gateway.http_protocol import TimedHttpProtocol
from kubesgl.services.gateway.migration import MigrationPolicy
from kubesgl.services.gateway.ops_routes import not_ready_reason
from kubesgl.services.gateway.responder import KeepServerSend
from kubesgl.services.gateway.workers import WorkerBoard, supervise
from starlette.exceptions import HTTPException

log = logging.getLogger("kubesgl.gateway")

RETRY_AFTER_S = "1"
_READY_PUBLISH_S = 0.5  # how often a worker writes its readiness to the workers' board


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    _log_to_stderr(config)
    if config.workers > 1:
        return supervise(config, serve_worker)
    serve(config)
    return 0


def _log_to_stderr(config: GatewayConfig) -> None:
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def serve_worker(config: GatewayConfig, board: WorkerBoard, index: int) -> None:
    """One of --workers gateway processes (spawned by workers.supervise)."""
    # Its own process group: a terminal's Ctrl-C reaches only the supervisor, which sends each worker one
    # SIGTERM (a second signal would cut uvicorn's drain short). It dies with the supervisor.
    os.setpgrp()
    parent_death_signal()
    _log_to_stderr(config)
    serve(config, board, index)


def serve(config: GatewayConfig, board: WorkerBoard | None = None, index: int = 0) -> None:
    app = build_app(config, board, index)
    server = _Server(
        app,
        uvicorn.Config(
            KeepServerSend(app),  # an SSE body's pieces skip the middlewares' send wrappers
            http=TimedHttpProtocol,  # a connection's first request is timed from its bytes' arrival
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,  # paths only, but per-request lines drown the service's own logs under load
            timeout_graceful_shutdown=int(config.drain_timeout_s),
            timeout_keep_alive=30,
        ),
    )
    server.run([config.sock] if config.sock is not None else None)


class _Server(uvicorn.Server):
    def __init__(self, app: FastAPI, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._app = app

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        freeze_heap()  # this process is the gateway's: its startup objects leave the collector's view

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's drain waits `timeout_graceful_shutdown` for open responses, then cancels them, which cuts a
        stream off mid-body (the client sees an incomplete chunked read). A second before that, every request
        still open ends with a clear 503 instead: an error event on a stream, an error body otherwise."""
        grace = float(self.config.timeout_graceful_shutdown or 0)
        timer = asyncio.get_running_loop().call_later(max(grace - 1.0, grace / 2), self._fail_open)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    def _fail_open(self) -> None:
        gateway: Gateway | None = getattr(self._app.state, "gateway", None)
        if gateway is not None:
            err = ServiceUnavailableError("the gateway shut down before the request finished; retry")
            log.warning("drain timeout: ending %d open request(s)", gateway.bus.fail_open(err))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after draining; drained is a clean exit (0), as for the other services.
        self._captured_signals.clear()


def build_app(config: GatewayConfig, board: WorkerBoard | None = None, index: int = 0) -> FastAPI:
    """The gateway's app; `board` and `index` make it worker `index` of a multi-process gateway."""
    api_keys = ApiKeys.from_file(config.api_keys_file)  # a bad keys file fails at start, not per request
    registry = new_registry()
    metrics = GatewayMetrics(registry)
    tracing = Tracing("kubesgl-gateway")

    async def start(app: FastAPI) -> Gateway:
        nc = await connect(
            NatsSettings.from_env(config.nats_url),
            name=f"gateway-{config.gateway_id}",
            on_reconnect=metrics.nats.on_reconnect,
            eager=True,  # a burst's first admission leaves while the gateway parses the rest (EagerClient)
        )
        bus = GatewayBus(
            nc, config.gateway_id, SchedulerRegistry(), metrics.nats, config.tokenize_attempt_timeout_s
        )
        bus.migration = MigrationPolicy(
            config.max_migrations, metrics.migrations, tracing, config.max_migration_seconds
        )
        await bus.start()
        app.state.gateway = Gateway(config, bus, metrics, tracing)
        log.info("gateway %s serving on http://%s:%d", config.gateway_id, config.host, config.port)
        return app.state.gateway

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Connect in the background: /health answers at once, /ready (and the API) once NATS is reached.
        starting = asyncio.create_task(start(app))
        starting.add_done_callback(_log_start_failure)
        publishing = asyncio.create_task(_publish_readiness(app, board, index)) if board else None
        try:
            yield
        finally:
            if publishing is not None:
                publishing.cancel()
            if starting.done() and not starting.cancelled() and starting.exception() is None:
                gw = starting.result()
                await gw.bus.stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(gw.bus.nc.drain(), 5.0)
            else:
                starting.cancel()
            tracing.shutdown()

    app = FastAPI(title="kubesgl gateway", version=__version__, lifespan=lifespan)
    # A multi-process gateway's /metrics sums every worker's (prometheus_client's multiprocess mode).
    app.state.metrics_registry = registry if board is None else multiprocess_registry(board.pids)
    app.state.workers = board
    for module in (openai_routes, native_routes, ops_routes):
        app.include_router(module.router)
    _add_error_handlers(app)
    # Last added runs first: the key check precedes the size limit, so an anonymous client learns nothing.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyCheck, keys=api_keys)
    app.add_middleware(AccessLog)  # outermost: 401s and 413s get their line too
    return app


async def _publish_readiness(app: FastAPI, board: WorkerBoard, index: int) -> None:
    while True:
        board.set_ready(index, not_ready_reason(getattr(app.state, "gateway", None)) is None)
        await asyncio.sleep(_READY_PUBLISH_S)


def _log_start_failure(task: asyncio.Task[Gateway]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("gateway could not start; it stays unready", exc_info=task.exception())


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KubesglError)
    async def kubesgl_error(_: Request, err: KubesglError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, err: RequestValidationError) -> JSONResponse:
        gw: Gateway | None = getattr(request.app.state, "gateway", None)
        if gw is not None:  # the route never ran: count the 400 here
            start = arrival_of(request.scope).perf_s
            gw.metrics.request("unknown", request.url.path, start=start).finish(400)
        return error_response(error_from_validation(err.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, err: HTTPException) -> JSONResponse:
        wrapped = InvalidRequestError(str(err.detail))
        wrapped.status = err.status_code
        return error_response(wrapped)

    @app.exception_handler(Exception)
    async def internal_error(_: Request, err: Exception) -> JSONResponse:
        log.exception("unhandled error")
        return error_response(KubesglError("internal error"))


def error_response(err: KubesglError) -> JSONResponse:
    headers = {"Retry-After": RETRY_AFTER_S} if err.status in (429, 503) else None
    return JSONResponse(error_body(err), status_code=err.status, headers=headers)
