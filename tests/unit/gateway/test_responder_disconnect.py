"""The SSE response's body runs until the client leaves (responder._until_client_leaves): a disconnect cancels the
body and the response ends normally; any other cancellation or error goes on to the caller."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from kubesgl.services.gateway.responder import _until_client_leaves


class Client:
    """A FAKE ASGI `receive` (stands for uvicorn's): blocks until `leave()`, then says http.disconnect."""

    def __init__(self) -> None:
        self._gone = asyncio.Event()
        self.reads = 0

    def leave(self) -> None:
        self._gone.set()

    async def receive(self) -> dict[str, str]:
        self.reads += 1
        await self._gone.wait()
        return {"type": "http.disconnect"}


async def test_a_body_that_ends_returns_and_stops_the_listener() -> None:
    client = Client()
    done = []

    async def body() -> None:
        await asyncio.sleep(0)
        done.append(True)

    await _until_client_leaves(body(), client.receive)
    assert done == [True]
    client.leave()
    await asyncio.sleep(0.01)
    assert asyncio.current_task().cancelling() == 0  # the listener, cancelled, did not touch this task


async def test_a_disconnect_cancels_the_body_and_the_response_ends_normally() -> None:
    client = Client()
    seen = []

    async def body() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            seen.append("cancelled")
            raise

    asyncio.get_running_loop().call_later(0.01, client.leave)
    await asyncio.wait_for(_until_client_leaves(body(), client.receive), 5)
    assert seen == ["cancelled"]
    assert asyncio.current_task().cancelling() == 0
    await asyncio.sleep(0)  # no cancellation left pending on this task


async def test_a_body_that_swallows_the_disconnect_still_leaves_no_cancellation_behind() -> None:
    client = Client()

    async def body() -> None:
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(30)

    asyncio.get_running_loop().call_later(0.01, client.leave)
    await _until_client_leaves(body(), client.receive)
    assert asyncio.current_task().cancelling() == 0


async def test_another_cancellation_goes_on() -> None:
    client = Client()

    async def respond() -> None:
        await _until_client_leaves(asyncio.sleep(30), client.receive)

    task = asyncio.ensure_future(respond())
    await asyncio.sleep(0.01)
    task.cancel()  # e.g. the server's shutdown
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_an_error_of_the_body_goes_on() -> None:
    client = Client()

    async def body() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await _until_client_leaves(body(), client.receive)
