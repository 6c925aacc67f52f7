"""`kubesgl gateway`: builds the FastAPI app (routes, error handlers, guards) around one NATS connection and
runs it under uvicorn. `add_arguments`/`main` are what `kubesgl.cli` calls."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from types import FrameType

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from kubesgl import __version__
from kubesgl.errors import InvalidRequestError, KubesglError
from kubesgl.openai_api.http_errors import error_body, error_from_validation
from kubesgl.routing import SchedulerRegistry
from kubesgl.service.nats_conn import NatsSettings, connect
from kubesgl.service.telemetry.metrics import GatewayMetrics, new_registry
from kubesgl.service.telemetry.tracing import Tracing
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
from starlette.exceptions import HTTPException

log = logging.getLogger("kubesgl.gateway")

RETRY_AFTER_S = "1"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)


def main(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    logging.basicConfig(
        level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    app = build_app(config)
    server = _Server(
        uvicorn.Config(
            app,
            http=TimedHttpProtocol,  # a connection's first request is timed from its bytes' arrival
            host=config.host,
            port=config.port,
            log_level=config.log_level,
            access_log=False,  # paths only, but per-request lines drown the service's own logs under load
            timeout_graceful_shutdown=int(config.drain_timeout_s),
            timeout_keep_alive=30,
        )
    )
    server.run([config.sock] if config.sock is not None else None)
    return 0


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal after draining; drained is a clean exit (0), as for the other services.
        self._captured_signals.clear()


def build_app(config: GatewayConfig) -> FastAPI:
    api_keys = ApiKeys.from_file(config.api_keys_file)  # a bad keys file fails at start, not per request
    registry = new_registry()
    metrics = GatewayMetrics(registry)
    tracing = Tracing("kubesgl-gateway")

    async def start(app: FastAPI) -> Gateway:
        nc = await connect(
            NatsSettings.from_env(config.nats_url),
            name=f"gateway-{config.gateway_id}",
            on_reconnect=metrics.nats.on_reconnect,
        )
        bus = GatewayBus(
            nc, config.gateway_id, SchedulerRegistry(), metrics.nats, config.tokenize_attempt_timeout_s
        )
        bus.migration = MigrationPolicy(config.max_migrations, metrics.migrations, tracing)
        await bus.start()
        app.state.gateway = Gateway(config, bus, metrics, tracing)
        log.info("gateway %s serving on http://%s:%d", config.gateway_id, config.host, config.port)
        return app.state.gateway

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # Connect in the background: /health answers at once, /ready (and the API) once NATS is reached.
        starting = asyncio.create_task(start(app))
        starting.add_done_callback(_log_start_failure)
        try:
            yield
        finally:
            if starting.done() and not starting.cancelled() and starting.exception() is None:
                gw = starting.result()
                await gw.bus.stop()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(gw.bus.nc.drain(), 5.0)
            else:
                starting.cancel()
            tracing.shutdown()

    app = FastAPI(title="kubesgl gateway", version=__version__, lifespan=lifespan)
    app.state.metrics_registry = registry
    for module in (openai_routes, native_routes, ops_routes):
        app.include_router(module.router)
    _add_error_handlers(app)
    # Last added runs first: the key check precedes the size limit, so an anonymous client learns nothing.
    app.add_middleware(BodySizeLimit, max_bytes=config.max_body_bytes)
    app.add_middleware(ApiKeyCheck, keys=api_keys)
    app.add_middleware(AccessLog)  # outermost: 401s and 413s get their line too
    return app


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
