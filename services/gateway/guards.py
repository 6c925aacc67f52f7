"""ASGI middleware that runs before any route parses a body: the API key check (401) and the request body
size limit (413). Both answer with an OpenAI error body."""

from __future__ import annotations

import json

from kubesgl.errors import KubesglError, PayloadTooLargeError
from kubesgl.openai_api.http_errors import error_body
from kubesgl.services.gateway.api_keys import ApiKeys
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Probes and scrapes stay open: kubelet and Prometheus hold no API key.
_OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


async def send_error(send: Send, err: KubesglError) -> None:
    body = json.dumps(error_body(err)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class ApiKeyCheck:
    def __init__(self, app: ASGIApp, keys: ApiKeys) -> None:
        self.app, self.keys = app, keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        auth = next((v.decode("latin-1") for k, v in scope["headers"] if k == b"authorization"), None)
        try:
            key = self.keys.authenticate(auth)
        except KubesglError as err:
            await send_error(send, err)
            return
        scope.setdefault("state", {})["api_key"] = key
        await self.app(scope, receive, send)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = PayloadTooLargeError(f"request body exceeds {self.max_bytes} bytes")
        length = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await send_error(send, too_large)
            return
        received = 0
        rejected = False

        async def limited_receive() -> Message:
            nonlocal received, rejected
            message = await receive()
            if message["type"] == "http.request" and not rejected:
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    rejected = True
                    await send_error(send, too_large)
                    return {"type": "http.disconnect"}  # the route stops reading; its answer is dropped
            return message

        async def guarded_send(message: Message) -> None:
            if not rejected:
                await send(message)

        await self.app(scope, limited_receive, guarded_send)
