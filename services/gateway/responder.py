"""Answers one generation request from its ChoiceGroup: admission first (so a refusal is a plain HTTP error
with its status), then either an SSE stream or one JSON body. A client that goes away aborts the request at
its schedulers; an error after the stream started is sent as an SSE error event before `[DONE]`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kubesgl.errors import KubesglError
from kubesgl.openai_api.http_errors import error_body
from kubesgl.openai_api.responses import sse
from kubesgl.services.gateway.choice_group import ChoiceGroup
from kubesgl.services.gateway.encoders import Encoder
from kubesgl.services.gateway.request_scope import CLIENT_CLOSED, RequestScope
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kubesgl.gateway")

T = TypeVar("T")
_DISCONNECT_POLL_S = 0.5
_DONE = sse("[DONE]")  # every stream's last event


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


async def respond(
    request: Request,
    scope: RequestScope,
    group: ChoiceGroup,
    encoder: Encoder,
    stream: bool,
    include_usage: bool = False,
) -> Response:
    try:
        await until_disconnect(request, group.admit())
        if stream:
            events = _sse_events(group, encoder, scope, include_usage)
            # The stream's own end records the real status first; this only catches a body never iterated.
            return ClosingStreamingResponse(events, on_close=lambda: _close(group, scope, CLIENT_CLOSED))
        results = await until_disconnect(request, group.collect())
    except KubesglError as e:
        _close(group, scope, e.status)
        raise
    except ClientGone:
        _close(group, scope, CLIENT_CLOSED)
        return Response(status_code=CLIENT_CLOSED)
    except BaseException:
        _close(group, scope, 500)
        raise
    scope.metrics.on_answer(sum(r.completion_tokens for r in results))
    _close(group, scope, 200)
    return JSONResponse(encoder.final(results))


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, cancelling it (and raising ClientGone) if the client disconnects meanwhile."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise ClientGone()
    finally:
        task.cancel()


def _close(group: ChoiceGroup, scope: RequestScope, status: int) -> None:
    group.close()
    scope.finish(status, group.rid, group.prompt_tokens())


async def _sse_events(
    group: ChoiceGroup, encoder: Encoder, scope: RequestScope, include_usage: bool
) -> AsyncIterator[bytes]:
    """The stream's bytes, one piece per write: an event's chunks together, and the end of the stream (the last
    event of a single choice, the usage chunk, an error event, [DONE]) together, so a stream's end is one write
    (with the body's terminator, which the response adds to the last piece's write)."""
    status = CLIENT_CLOSED  # unless the stream reaches its end
    tail: list[bytes] = []
    single = len(group.choices) == 1
    try:
        for chunk in encoder.prelude():
            yield sse(chunk)
        unsent = 0  # tokens whose chunk is still held back (no text yet): timed when the client gets them
        async for event in group.events():
            unsent += len(event.token_ids)
            frames = [sse(chunk) for chunk in encoder.chunks(event)]
            if single and event.finish_reason is not None:
                tail += frames  # the choice's last event: the stream ends right after it
                continue
            if frames:
                yield b"".join(frames)
                scope.metrics.on_tokens(unsent)
                unsent = 0
        scope.metrics.on_tokens(unsent)  # the last event's tokens, timed as they go into the final write
        if include_usage:
            tail.append(sse(encoder.usage_chunk()))
        status = 200
    except KubesglError as e:
        status = e.status
        tail.append(sse(error_body(e)))
    except Exception:
        log.exception("stream failed")
        status = 500
        tail.append(sse(error_body(KubesglError("internal error"))))
    finally:
        # Runs on a client disconnect too (the generator is cancelled): free the request's pages at once.
        _close(group, scope, status)
    tail.append(_DONE)
    yield b"".join(tail)


class ClosingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however it ends, even if its body is never iterated, and ends
    the body with the piece that carries [DONE] (one write for the stream's end and the chunked terminator,
    where StreamingResponse sends an empty last message: one more write per request)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        ended = False
        async for piece in self.body_iterator:
            # Only the stream's last piece ends with the [DONE] event: every other event is a JSON object.
            ended = isinstance(piece, bytes) and piece.endswith(_DONE)
            await send({"type": "http.response.body", "body": piece, "more_body": not ended})
        if not ended:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
