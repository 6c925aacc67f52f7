"""SseWriter: one SSE body written in order from a stream's task and from deltas' deliveries, one write per stream
per loop turn, and a send that has to wait (a client that stopped reading) holding everything behind it.

The `send` here is a FAKE of the ASGI server's send (what these tests are not about): it records each message,
and `SlowSend` can be told to wait on a future, as uvicorn's send waits while the transport is paused."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubesgl.protocol import TextDelta
from kubesgl.services.gateway.app import build_app
from kubesgl.services.gateway.config import GatewayConfig
from kubesgl.services.gateway.request_stream import RequestStream
from kubesgl.services.gateway.sse_writer import SseWriter


class SlowSend:
    """FAKE server send: records body messages; while `gate` is set, each send waits for it first."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.gate: asyncio.Future[None] | None = None
        self.raises: BaseException | None = None

    async def __call__(self, message: dict[str, Any]) -> None:
        if self.raises is not None:
            raise self.raises
        if self.gate is not None:
            await self.gate
        self.messages.append(message)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages]


def _render(items: list[str]) -> bytes:
    return ("[" + "".join(items) + "]").encode()


async def _turn() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


async def test_items_added_in_one_turn_go_out_as_one_rendered_write_and_their_tokens_are_timed_then() -> None:
    send, sent = SlowSend(), []
    w: SseWriter[str] = SseWriter(send, _render, on_sent=sent.append)
    w.add("a", 1)
    w.add("b", 2)
    assert send.messages == [] and sent == []  # nothing before the loop turns
    await _turn()
    assert send.bodies() == [b"[ab]"] and sent == [3]
    assert send.messages[0]["more_body"] is True
    w.add("c", 1)
    await _turn()
    await w.end(b"END")
    assert send.bodies() == [b"[ab]", b"[c]", b"END"] and sent == [3, 1]
    assert [m["more_body"] for m in send.messages] == [True, True, False]
    w.add("late", 1)  # after the end: dropped
    await _turn()
    assert len(send.messages) == 3


async def test_an_abandoned_writer_writes_nothing_more() -> None:
    send = SlowSend()
    w: SseWriter[str] = SseWriter(send, _render)
    w.add("a", 1)
    w.abandon()  # before the loop turned
    w.add("b", 1)
    await _turn()
    await w.end(b"E")
    assert send.messages == []


async def test_a_write_from_the_task_goes_after_what_was_added_before_it() -> None:
    send = SlowSend()
    w: SseWriter[str] = SseWriter(send, _render)
    w.add("a", 1)
    await w.write(b"T")  # before the loop turned: the staged item first, in the same write
    assert send.bodies() == [b"[a]T"]
    w.count(2)  # tokens whose bytes come later
    await _turn()
    assert send.bodies() == [b"[a]T"]  # no bytes: no write
    await w.end(b"E")
    assert send.bodies() == [b"[a]T", b"E"]


async def test_a_send_that_waits_holds_everything_behind_it_in_order() -> None:
    send = SlowSend()
    w: SseWriter[str] = SseWriter(send, _render)
    send.gate = asyncio.get_running_loop().create_future()
    w.add("a", 1)
    await _turn()  # the write of [a] waits on the client
    w.add("b", 1)
    w.add("c", 1)
    await _turn()
    assert send.messages == []
    ended = asyncio.create_task(w.end(b"E"))
    await _turn()
    assert not ended.done()
    gate, send.gate = send.gate, None
    gate.set_result(None)
    await asyncio.wait_for(ended, 5)
    await _turn()
    assert b"".join(send.bodies()) == b"[a][bc]E"
    assert send.messages[-1]["more_body"] is False
    assert all(m["more_body"] for m in send.messages[:-1])


async def test_a_send_that_failed_in_a_turn_fails_the_tasks_next_write() -> None:
    send = SlowSend()
    w: SseWriter[str] = SseWriter(send, _render)
    send.raises = ConnectionResetError("gone")
    w.add("a", 1)
    await _turn()
    with pytest.raises(ConnectionResetError):
        await w.write(b"T")


async def test_a_render_that_fails_is_reported_and_later_items_still_go_out() -> None:
    send, errors = SlowSend(), []

    def render(items: list[str]) -> bytes:
        if "bad" in items:
            raise ValueError("cannot render")
        return _render(items)

    w: SseWriter[str] = SseWriter(send, render, on_render_error=errors.append)
    w.add("bad", 1)
    await _turn()
    assert [type(e) for e in errors] == [ValueError] and send.messages == []
    w.add("ok", 1)
    await w.end(b"E")
    assert send.bodies() == [b"[ok]E"]


async def test_a_request_stream_sink_takes_deltas_only_while_none_wait_for_next() -> None:
    taken: list[str] = []

    def sink(delta: TextDelta) -> bool:  # takes every delta but one whose text is "no"
        if delta.text == "no":
            return False
        taken.append(delta.text)
        return True

    s = RequestStream("r")
    s.adopt("a")
    s.set_sink(sink)
    s.offer(TextDelta(rid="r", instance_id="a", seq=0, text="x"))
    s.offer(TextDelta(rid="r", instance_id="a", seq=1, text="no"))  # declined: queued
    s.offer(TextDelta(rid="r", instance_id="a", seq=2, text="y"))  # one waits: queued behind it, in order
    assert taken == ["x"]
    assert [(await s.next(0.01)).text for _ in range(2)] == ["no", "y"]  # type: ignore[union-attr]
    s.offer(TextDelta(rid="r", instance_id="a", seq=3, text="z"))  # the queue is empty again
    assert taken == ["x", "z"]


def test_an_sse_body_may_skip_the_send_wrappers_of_every_layer_the_gateway_app_has() -> None:
    """KeepServerSend sends SSE bodies past the middlewares: each layer here was read for what its send wrapper
    does (the response's start only). A layer added by us or by a FastAPI/Starlette upgrade fails this until it
    is read too, and added here (or, if it looks at bodies, the bypass goes)."""
    app = build_app(GatewayConfig())
    layers, node = [], app.build_middleware_stack()
    while type(node).__name__ != "APIRouter":
        layers.append(type(node).__name__)
        node = node.app
    starlette_and_fastapi = [
        "ServerErrorMiddleware",  # marks the response started (start only)
        "ExceptionTelemetryMiddleware",  # wraps no send
        "AppBodyLimitMiddleware",  # marks the response started (start only); limits the request's body
        "ExceptionMiddleware",  # marks the response started (start only)
        "AsyncExitStackMiddleware",  # wraps no send
    ]
    gateways_own = [
        "AccessLog",  # records the start's status
        "ApiKeyCheck",  # answers a refused request itself; passes `send` on untouched
        "BodySizeLimit",  # drops every message once the request's body was refused (no stream started then)
    ]
    assert sorted(layers) == sorted([*starlette_and_fastapi, *gateways_own])
