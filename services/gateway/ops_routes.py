"""Operational routes: /health (process alive), /ready (NATS connected and a scheduler live), /metrics
(Prometheus), and /v1/models (the models live schedulers announce)."""

from __future__ import annotations

import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from kubesgl.errors import ModelNotFoundError
from kubesgl.runtime.telemetry.metrics import render
from kubesgl.services.gateway.gateway import Gateway, gateway_of
from kubesgl.services.gateway.workers import WorkerBoard

router = APIRouter()


@router.get("/health")
async def health() -> PlainTextResponse:
    return PlainTextResponse("ok\n")


@router.get("/ready")
async def ready(request: Request) -> PlainTextResponse:
    reason = not_ready_reason(getattr(request.app.state, "gateway", None))
    board: WorkerBoard | None = getattr(request.app.state, "workers", None)
    if reason is None and board is not None and (waiting := board.not_ready()):
        # The kernel gives connections to every worker of the port: ready only when all of them are.
        reason = f"gateway worker {', '.join(map(str, waiting))} not ready"
    if reason is not None:
        return PlainTextResponse(f"not ready: {reason}\n", status_code=503)
    return PlainTextResponse("ready\n")


def not_ready_reason(gw: Gateway | None) -> str | None:
    """Why this gateway process cannot serve requests now, or None."""
    if gw is None or not gw.bus.connected:
        return "NATS disconnected"
    if not any(not hb.draining for hb in gw.registry.live()):
        return "no live scheduler"
    return None


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    body, content_type = render(request.app.state.metrics_registry)
    return Response(body, media_type=content_type)


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    gw = gateway_of(request)
    models = gw.models()
    return JSONResponse({"object": "list", "data": [_card(m, ctx) for m, ctx in sorted(models.items())]})


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> JSONResponse:
    gw = gateway_of(request)
    models = gw.models()
    if model not in models:
        raise ModelNotFoundError(f"The model '{model}' does not exist", param="model")
    return JSONResponse(_card(model, models[model]))


def _card(model: str, context_len: int) -> dict[str, object]:
    return {
        "id": model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "kubesgl",
        "max_model_len": context_len,
    }
