"""POST /generate: SGLang's native API ({text | input_ids, sampling_params, stream}) over the same path."""

from __future__ import annotations

import uuid

from fastapi import APIRouter, Request
from fastapi.responses import Response
from kubesgl.errors import InvalidRequestError, ServiceUnavailableError
from kubesgl.openai_api.generation_spec import native_spec
from kubesgl.openai_api.prompt_inputs import native_prompt
from kubesgl.openai_api.request_models import NativeGenerateRequest
from kubesgl.protocol import PromptKind, TokenizeRequest
from kubesgl.services.gateway.encoders import NativeEncoder
from kubesgl.services.gateway.gateway import Gateway, gateway_of
from kubesgl.services.gateway.openai_routes import fan_out, session_id
from kubesgl.services.gateway.request_scope import RequestScope
from kubesgl.services.gateway.responder import respond

router = APIRouter()


@router.post("/generate", response_model=None)
async def generate(body: NativeGenerateRequest, request: Request) -> Response:
    gw = gateway_of(request)
    scope = RequestScope(gw, request, "/generate", body.model)
    try:
        model = body.model or _only_model(gw)
        gw.check_model(model)
        spec = native_spec(body)
        rid = f"gen-{uuid.uuid4().hex}"
        base = TokenizeRequest(
            rid=rid,
            gateway_id=gw.bus.gateway_id,
            model=model,
            kind=PromptKind.COMPLETION,
            sampling=spec.params,
            deadline=gw.deadline(request),
            session_id=session_id(request),
        )
        group = fan_out(gw, scope, base, [native_prompt(body.text, body.input_ids)], spec)
    except BaseException as e:
        scope.finish(getattr(e, "status", 500))
        raise
    return await respond(request, scope, group, NativeEncoder(rid), spec.stream)


def _only_model(gw: Gateway) -> str:
    # SGLang's /generate names no model; that is unambiguous only while one model is served.
    models = sorted(gw.models())
    if not models:
        raise ServiceUnavailableError("no scheduler is available; retry shortly")
    if len(models) > 1:
        raise InvalidRequestError(
            f"several models are served ({', '.join(models)}); set 'model'", param="model"
        )
    return models[0]
