"""POST /v1/chat/completions and /v1/completions: validate, fan out into choices, answer via the responder.
`fan_out` is shared with the native /generate route."""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from kubesgl.errors import InvalidRequestError
from kubesgl.openai_api.generation_spec import MAX_N, GenerationSpec, chat_spec, completion_spec
from kubesgl.openai_api.prompt_inputs import PromptInput, chat_messages, completion_prompts
from kubesgl.openai_api.request_models import ChatCompletionRequest, CompletionRequest
from kubesgl.protocol import PromptKind, TokenizeRequest
from kubesgl.services.gateway.choice_group import ChoiceGroup
from kubesgl.services.gateway.encoders import ChatEncoder, CompletionEncoder
from kubesgl.services.gateway.gateway import Gateway, gateway_of
from kubesgl.services.gateway.generation import ChoiceGeneration, Limits
from kubesgl.services.gateway.request_scope import RequestScope
from kubesgl.services.gateway.responder import respond

router = APIRouter()


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    gw = gateway_of(request)
    scope = RequestScope(gw, request, "/v1/chat/completions", body.model)
    try:
        gw.check_model(body.model)
        spec = chat_spec(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        messages = chat_messages(body.messages)
        base = TokenizeRequest(
            rid=rid,
            gateway_id=gw.bus.gateway_id,
            model=body.model,
            kind=PromptKind.CHAT,
            sampling=spec.params,
            deadline=gw.deadline(request),
            messages=messages,
            add_generation_prompt=body.add_generation_prompt,
            chat_template_kwargs=body.chat_template_kwargs,
            session_id=session_id(request, body.user),
            tools=spec.tool_use.tools,
            tool_choice=spec.tool_use.choice,
            parallel_tool_calls=spec.tool_use.parallel,
        )
        group = fan_out(gw, scope, base, [None], spec)
    except BaseException as e:
        scope.finish(getattr(e, "status", 500))
        raise
    encoder = ChatEncoder(
        rid, body.model, spec.n, spec.include_usage, group.tool_format, spec.tool_use.parallel
    )
    return await respond(request, scope, group, encoder, spec.stream, spec.include_usage)


@router.post("/v1/completions", response_model=None)
async def completions(body: CompletionRequest, request: Request) -> Response:
    gw = gateway_of(request)
    scope = RequestScope(gw, request, "/v1/completions", body.model)
    try:
        gw.check_model(body.model)
        spec = completion_spec(body)
        prompts = completion_prompts(body.prompt)
        rid = f"cmpl-{uuid.uuid4().hex}"
        base = TokenizeRequest(
            rid=rid,
            gateway_id=gw.bus.gateway_id,
            model=body.model,
            kind=PromptKind.COMPLETION,
            sampling=spec.params,
            deadline=gw.deadline(request),
            session_id=session_id(request, body.user),
        )
        group = fan_out(gw, scope, base, prompts, spec)
    except BaseException as e:
        scope.finish(getattr(e, "status", 500))
        raise
    encoder = CompletionEncoder(rid, body.model, len(prompts), spec.include_usage)
    return await respond(request, scope, group, encoder, spec.stream, spec.include_usage)


SESSION_HEADER = "x-session-id"


def session_id(request: Request, user: str | None = None) -> str | None:
    """The session a router may keep on one instance: header x-session-id, else the OpenAI `user` field."""
    return request.headers.get(SESSION_HEADER) or user or None


def fan_out(
    gw: Gateway,
    scope: RequestScope,
    base: TokenizeRequest,
    prompts: list[PromptInput | None],
    spec: GenerationSpec,
) -> ChoiceGroup:
    """One child per (prompt, sample): choice index p * n + i, rid `<rid>-<index>` when there are several."""
    total = len(prompts) * spec.n
    if total > MAX_N:
        raise InvalidRequestError(f"{len(prompts)} prompts x n={spec.n} exceeds {MAX_N} choices", param="n")
    limits = Limits(deadline=base.deadline, inactivity_s=gw.config.inactivity_timeout_s)
    choices = []
    for p, prompt in enumerate(prompts):
        for i in range(spec.n):
            index = p * spec.n + i
            req = replace(
                base,
                rid=base.rid if total == 1 else f"{base.rid}-{index}",
                sampling=spec.params_for_choice(i),
                **_prompt_fields(prompt),
            )
            choices.append(
                ChoiceGeneration(
                    gw.bus, index, req, spec.stop, limits, scope.traceparent, spec.logprobs, spec.echo
                )
            )
    return ChoiceGroup(choices, base.rid, spec.n)


def _prompt_fields(prompt: PromptInput | None) -> dict[str, Any]:
    if prompt is None:
        return {}
    if prompt.text is not None:
        return {"kind": PromptKind.COMPLETION, "prompt": prompt.text}
    return {"kind": PromptKind.TOKENS, "input_ids": list(prompt.input_ids or ())}
