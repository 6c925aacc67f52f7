"""One SSE response body, written in order from two sides: the stream's own task (`write`, `end`: awaited, as a
response body is), and a delta's delivery (`add`: synchronous, from the bus's callback, for a plain stream's
events; ChoiceGeneration.push_events).

What `add` is given goes out when the event loop next turns, together with everything else the stream got by
then: one write per stream per turn, however many deltas a NATS batch or a backlog of batches carried for it, and
the items `add` staged meanwhile rendered together (`render`: a stream's events as one SSE chunk). The
write drives the ASGI `send` coroutine by hand: every layer of the send chain (the middlewares' wrappers, uvicorn's
`send`) returns without waiting unless the client has stopped reading and uvicorn pauses the writer, so a write
costs no task switch, no wake of the stream's task and no async-generator hop. When `send` does wait, the rest
of it runs in a task of its own, and nothing else is written until it ends (bytes stay in order).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

from kubesgl.runtime.loop_local import LoopLocal
from starlette.types import Message, Send

log = logging.getLogger("kubesgl.gateway")
T = TypeVar("T")


class SseWriter(Generic[T]):
    def __init__(
        self,
        send: Send,
        render: Callable[[list[T]], bytes],
        on_sent: Callable[[int], None] = lambda n: None,
        on_render_error: Callable[[Exception], None] = lambda e: None,
    ) -> None:
        """`render(items)`: the bytes of items `add` staged, in one piece; `on_sent(n)`: `n` tokens are going to
        the client now (what the gateway's TTFT and ITL time); `on_render_error(e)`: `render` raised `e` (its
        items are dropped: whoever staged them ends the stream with the error)."""
        self._send = send
        self._render = render
        self._on_sent = on_sent
        self._on_render_error = on_render_error
        self._staged: list[T] = []  # add's, rendered when the next piece or write comes
        self._pending: list[bytes] = []
        self._tokens = 0  # tokens of the pending pieces (and of events that had no bytes yet)
        self._scheduled = False  # in the loop's flush list
        self._inflight: asyncio.Future[None] | None = None  # a write that waits on the client
        self._error: BaseException | None = None  # a send that failed outside the stream's task
        self._ended = False
        self._flusher = _flushers.get()

    def add(self, item: T, tokens: int) -> None:
        """Stages `item` (its `tokens` timed when it goes out) for the loop's next turn."""
        if self._ended:
            return
        self._staged.append(item)
        self._tokens += tokens
        if not self._scheduled:
            self._scheduled = True
            self._flusher.schedule(self)

    def count(self, tokens: int) -> None:
        """`tokens` go out with the next write (whose bytes carry them)."""
        self._tokens += tokens

    async def write(self, piece: bytes, tokens: int = 0) -> None:
        """Sends `piece` after everything staged or queued before it."""
        self._queue(piece)
        self._tokens += tokens
        await self._drain(more=True)

    async def end(self, piece: bytes) -> None:
        """Sends the stream's last piece, after everything before it; later pieces are dropped."""
        if self._ended:
            return
        self._queue(piece)
        await self._drain(more=False)

    def abandon(self) -> None:
        """The response ends without its last piece (its task was cancelled): nothing more is written."""
        self._ended = True
        self._staged.clear()
        self._pending.clear()

    def _queue(self, piece: bytes) -> None:
        if self._staged:  # what add staged came first
            staged, self._staged = self._staged, []
            try:
                self._pending.append(self._render(staged))
            except Exception as e:  # noqa: BLE001 - a bug in rendering: the stream ends with it, not the loop
                log.exception("rendering a stream's events failed")
                self._on_render_error(e)
        if piece:
            self._pending.append(piece)

    def _message(self, more: bool) -> Message | None:
        """The pending bytes as one body message (None when there is nothing to send), counting its tokens."""
        self._queue(b"")
        if not self._pending and more:
            return None  # its tokens wait for bytes that carry them
        if self._tokens:
            tokens, self._tokens = self._tokens, 0
            self._on_sent(tokens)
        body = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not more:
            self._ended = True
        return {"type": "http.response.body", "body": body, "more_body": more}

    async def _drain(self, more: bool) -> None:
        while self._inflight is not None:
            await asyncio.wait({self._inflight})
        if self._error is not None:
            raise self._error
        message = self._message(more)
        if message is None:
            return
        self._inflight = asyncio.get_running_loop().create_future()
        try:
            await self._send(message)
        finally:
            self._release()

    def _release(self) -> None:
        done, self._inflight = self._inflight, None
        if done is not None and not done.done():
            done.set_result(None)
        if (self._pending or self._staged) and not self._scheduled and not self._ended:
            self._scheduled = True
            self._flusher.schedule(self)

    def flush(self) -> None:
        """The loop's turn (from _Flusher): sends what `add` queued, unless a write is under way (its end sends
        the rest)."""
        self._scheduled = False
        if self._inflight is not None or self._ended or self._error is not None:
            return
        message = self._message(more=True)
        if message is None:
            return
        coro = self._send(message)
        try:
            waits_on = coro.send(None)
        except StopIteration:
            return  # the usual case: written without waiting
        except BaseException as e:  # noqa: BLE001 - kept for the stream's task: its next write raises it
            self._error = e
            return
        self._inflight = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().create_task(self._finish(coro, waits_on))

    async def _finish(self, coro: Coroutine[Any, Any, None], waits_on: Any) -> None:
        """Runs the rest of a send that waited (as a task would run it), then sends what came meanwhile."""
        try:
            await _resume(coro, waits_on)
        except BaseException as e:  # noqa: BLE001 - kept for the stream's task
            self._error = e
        finally:
            self._release()


async def _resume(coro: Coroutine[Any, Any, None], waits_on: Any) -> None:
    """Continues `coro`, suspended on `waits_on` (what it yielded: a future, or None for a bare yield)."""
    try:
        while True:
            if waits_on is None:
                await asyncio.sleep(0)
            else:
                await asyncio.wait({waits_on})  # its outcome reaches `coro` when it resumes
            waits_on = coro.send(None)
    except StopIteration:
        return
    except asyncio.CancelledError:
        coro.close()
        raise


class _Flusher:
    """One per event loop: the writers with pending bytes, flushed together on the loop's next turn."""

    def __init__(self) -> None:
        self._dirty: list[SseWriter[Any]] = []

    def schedule(self, writer: SseWriter[Any]) -> None:
        if not self._dirty:
            asyncio.get_running_loop().call_soon(self._run)
        self._dirty.append(writer)

    def _run(self) -> None:
        dirty, self._dirty = self._dirty, []
        for writer in dirty:
            writer.flush()


_flushers = LoopLocal(_Flusher)
