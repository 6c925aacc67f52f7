"""Answers one generation request from its ChoiceGroup: admission first (so a refusal is a plain HTTP error
with its status), then either an SSE stream or one JSON body. A client that goes away aborts the request at
its schedulers; an error after the stream started is sent as an SSE error event before `[DONE]`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from kubesgl.errors import KubesglError
from kubesgl.openai_api.http_errors import error_body
from kubesgl.openai_api.responses import sse
from kubesgl.services.gateway.choice_group import ChoiceGroup
from kubesgl.services.gateway.encoders import Encoder
from kubesgl.services.gateway.generation import ChoiceEvent, joined
from kubesgl.services.gateway.request_scope import CLIENT_CLOSED, RequestScope
from kubesgl.services.gateway.sse_writer import SseWriter
from starlette.types import ASGIApp, Receive, Scope, Send

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
            # The stream's own end records the real status first; on_close only catches a body never started.
            return ClosingStreamingResponse(
                lambda send: _sse_stream(group, encoder, scope, include_usage, send),
                on_close=lambda: _close(group, scope, CLIENT_CLOSED),
            )
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
    """Awaits `work`, cancelling it (and raising ClientGone) if the client disconnects meanwhile. A watcher
    polls, where an SSE body has a listener (_until_client_leaves): an admission usually takes milliseconds,
    and a listener per request as well (a receive() call and its cancellation) cost more of the gateway's CPU
    per one-token request on the CPU proxy in 3 of 4 interleaved pairs (+16 % on average, in a wide spread).

    `work` runs in the caller's task, not a task of its own: a new task would start only after every task
    already ready, and a gateway that has just read a burst has one per request, so the burst's first
    admission was published after its last request was parsed. In place, each request's admission leaves
    (nats_conn.EagerClient) as its handler reaches it."""
    current = asyncio.current_task()
    assert current is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        while True:
            await asyncio.sleep(_DISCONNECT_POLL_S)
            if await request.is_disconnected():
                gone = True
                current.cancel()
                return

    watcher = asyncio.ensure_future(watch())
    try:
        return await work
    except asyncio.CancelledError:
        if gone and current.uncancel() == 0:  # our cancellation, not the server's: the client left
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()


def _close(group: ChoiceGroup, scope: RequestScope, status: int) -> None:
    group.close()
    scope.finish(status, group.rid, group.prompt_tokens())


async def _sse_stream(
    group: ChoiceGroup, encoder: Encoder, scope: RequestScope, include_usage: bool, send: Send
) -> None:
    """The stream's bytes: the prelude; then a single choice's events as its deltas arrive
    (ChoiceGeneration.push_events: each loop turn writes what the stream got in it as one SSE chunk), or several
    choices' events as they come out of the group; then the end of the stream (the last event of a single
    choice, the usage chunk, an error event, [DONE]) as one write, with the body's terminator."""
    status = CLIENT_CLOSED  # unless the stream reaches its end
    tail: list[bytes] = []
    single = len(group.choices) == 1
    writer: SseWriter[ChoiceEvent] = SseWriter(
        send,
        render=lambda events: encoder.frames(joined(events)),
        on_sent=scope.metrics.on_tokens,
        on_render_error=group.choices[0].fail_pushed,
    )
    try:
        await writer.write(b"".join(sse(chunk) for chunk in encoder.prelude()))
        if single:
            group.choices[0].push_events(lambda event: writer.add(event, len(event.token_ids)))
        async for event in group.events():
            if single and event.finish_reason is not None:
                # The choice's last event: it goes out with the end of the stream, its tokens timed then.
                tail.append(encoder.frames(event))
                writer.count(len(event.token_ids))
                continue
            await writer.write(encoder.frames(event), len(event.token_ids))
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
    except BaseException:
        writer.abandon()  # cancelled (the client went away): no loop turn may write its staged events
        raise
    finally:
        # Runs on a client disconnect too (the task is cancelled): free the request's pages at once.
        _close(group, scope, status)
    tail.append(_DONE)
    await writer.end(b"".join(tail))


# The server's own `send`, put in the scope by the outermost ASGI layer (KeepServerSend).
SERVER_SEND = "kubesgl.server_send"


class KeepServerSend:
    """The outermost ASGI layer: keeps the server's `send` in the scope, so that an SSE body's pieces go straight
    to it (ClosingStreamingResponse) instead of through every middleware's send wrapper. Starlette's error and
    exception middlewares, FastAPI's body-limit middleware and the gateway's own (AccessLog, ApiKeyCheck,
    BodySizeLimit) look only at the response's start, which still goes through all of them
    (tests/unit/gateway/test_sse_writer.py pins that list). Four wrappers were ~8 % of the gateway's CPU per
    streamed token."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[SERVER_SEND] = send
        await self.app(scope, receive, send)


class ClosingStreamingResponse(StreamingResponse):
    """An SSE response whose `body(send)` writes the body itself (through an SseWriter: StreamingResponse's
    iterator of pieces costs a task wake and an async-generator hop per piece), and that runs `on_close` however
    it ends, even if its body never starts. The client's disconnect cancels `body` (as StreamingResponse does
    under uvicorn's ASGI spec 2.3, but with one listener task instead of an anyio task group and its cancel
    scope, a per-request cost). The response's start goes through the middlewares' `send`, its body to the
    server's own (KeepServerSend) where the app runs under it."""

    def __init__(self, body: Callable[[Send], Awaitable[None]], on_close: Callable[[], None]) -> None:
        super().__init__(
            (),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._body, self._on_close = body, on_close
        self._server_send: Send | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._server_send = scope.get(SERVER_SEND)
        try:
            await _until_client_leaves(self.stream_response(send), receive)
        finally:
            self._on_close()

    async def stream_response(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
        await self._body(self._server_send or send)


async def _until_client_leaves(body: Awaitable[None], receive: Receive) -> None:
    """Runs `body` in this task while a task of its own reads `receive` for the client's disconnect, which
    cancels `body`; a body cut short so returns normally (as StreamingResponse's task group does), any other
    cancellation or error goes on."""
    this = asyncio.current_task()
    assert this is not None
    ended = left = False

    async def listen() -> None:
        nonlocal left
        while (await receive())["type"] != "http.disconnect":
            pass
        if not ended:
            left = True
            this.cancel()

    listener = asyncio.ensure_future(listen())
    try:
        await body
    except asyncio.CancelledError:
        # The client's leaving ends the response, not this task: that cancellation alone is taken back.
        if not left or this.uncancel() > 0:
            raise
        return
    finally:
        ended = True
        listener.cancel()
    if left:  # the body took the cancellation and returned
        this.uncancel()
