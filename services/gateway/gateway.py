"""The gateway's per-process state, handed to every route through `app.state.gateway`: the bus, scheduler
registry, metrics, tracing and per-key concurrency limit, plus the checks every generation request needs."""

from __future__ import annotations

import time

from fastapi import Request
from kubesgl.errors import InvalidRequestError, ModelNotFoundError, ServiceUnavailableError
from kubesgl.routing import SchedulerRegistry
from kubesgl.runtime.telemetry.metrics import GatewayMetrics
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.gateway.bus import GatewayBus
from kubesgl.services.gateway.concurrency_limit import ConcurrencyLimit
from kubesgl.services.gateway.config import GatewayConfig

TIMEOUT_HEADER = "x-request-timeout"


def gateway_of(request: Request) -> Gateway:
    """The app's Gateway; 503 while it is still connecting to NATS."""
    gw: Gateway | None = getattr(request.app.state, "gateway", None)
    if gw is None:
        raise ServiceUnavailableError("the gateway is still connecting to NATS; retry shortly")
    return gw


class Gateway:
    def __init__(
        self,
        config: GatewayConfig,
        bus: GatewayBus,
        metrics: GatewayMetrics,
        tracing: Tracing,
    ) -> None:
        self.config = config
        self.bus = bus
        self.metrics = metrics
        self.tracing = tracing
        self.limit = ConcurrencyLimit(config.max_concurrent_per_key)

    @property
    def registry(self) -> SchedulerRegistry:
        return self.bus.registry

    def models(self) -> dict[str, int]:
        """Models live schedulers serve, with their context length (the smallest, should instances differ)."""
        out: dict[str, int] = {}
        for hb in self.registry.live():
            out[hb.model] = min(out.get(hb.model, hb.context_len), hb.context_len)
        return out

    def check_model(self, model: str) -> None:
        """404 if no live scheduler serves `model`, 503 if none serves anything or all of its are draining."""
        models = self.models()
        if model not in models:
            if not models:
                raise ServiceUnavailableError("no scheduler is available; retry shortly")
            raise ModelNotFoundError(f"The model '{model}' does not exist", param="model")
        if not self.registry.candidates(model):
            raise ServiceUnavailableError(f"every scheduler for '{model}' is draining; retry shortly")

    def metrics_model(self, model: str | None) -> str:
        """A bounded label value: a served model id, else "unknown"."""
        return model if model and model in self.models() else "unknown"

    def deadline(self, request: Request) -> float:
        """Absolute unix deadline: --request-timeout, lowered (never raised) by the X-Request-Timeout header."""
        timeout = self.config.request_timeout_s
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is not None:
            try:
                asked = float(raw)
            except ValueError:
                raise InvalidRequestError(f"{TIMEOUT_HEADER} must be a number of seconds") from None
            if not asked > 0:
                raise InvalidRequestError(f"{TIMEOUT_HEADER} must be > 0")
            timeout = min(timeout, asked)
        return time.time() + timeout
