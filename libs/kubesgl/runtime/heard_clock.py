"""The time up to which a process has read everything NATS sent it: the clock to judge a peer's silence by.

A process that falls behind (CPU-starved, its event loop busy) has its peers' heartbeats waiting unread in its
socket; judged by the wall clock every peer then looks silent, and a gateway would migrate the streams of a live
scheduler. This clock advances only when a round trip through the server comes back: a message published to
the process's own inbox, which the server sends back after everything it sent this connection before it, so
every earlier message has been read by then and handed to its subscription, whose callback runs in the next
turns of the loop. Silence measured against it is the peer's own, never the reader's lag; while the connection
is down it stands still (an outage is nobody's death).

Not nats-py's flush (PING/PONG): a flush given up (timed out, or cancelled at shutdown) leaves a cancelled
future for its PONG, and the PONG's late arrival raises InvalidStateError inside nats-py's read loop, which ends
the loop: the connection stays up and is read no more. An echo that comes late is just a stale message.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.nats")

HEARD_INTERVAL_S = 0.25  # a round trip every quarter second: a PING and a PONG, nothing else


class HeardClock:
    """Call it for the monotonic time at which the last completed round trip started."""

    def __init__(
        self, nc: Client, interval_s: float = HEARD_INTERVAL_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._nc, self._interval_s, self._clock = nc, interval_s, clock
        self._at = clock()
        self._task: asyncio.Task[None] | None = None
        self._inbox: str | None = None
        self._sub: Subscription | None = None
        self._seq = 0
        self._waiting: dict[bytes, asyncio.Future[None]] = {}  # round trips in flight, by their echo's body

    def __call__(self) -> float:
        return self._at

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._sub is not None:
            with contextlib.suppress(Exception):  # a closed connection has nothing to unsubscribe
                await self._sub.unsubscribe()
            self._sub = None

    async def round_trip(self, timeout_s: float | None = None) -> bool:
        """One round trip; True (and the clock at its start) when the server answered within `timeout_s`
        (default: ten intervals, at least 1 s)."""
        sent = self._clock()
        self._seq += 1
        key = str(self._seq).encode()
        answered = self._waiting[key] = asyncio.get_running_loop().create_future()
        try:
            if self._sub is None:
                self._inbox = self._nc.new_inbox()
                self._sub = await self._nc.subscribe(self._inbox, cb=self._on_echo)
            await self._nc.publish(self._inbox, key)
            timeout = timeout_s if timeout_s is not None else max(1.0, 10 * self._interval_s)
            done, _ = await asyncio.wait({answered}, timeout=timeout)
        except nats.errors.Error:
            return False
        finally:
            self._waiting.pop(key, None)
        if not done:
            return False
        for _ in range(2):  # the subscriptions' tasks take what came before the echo
            await asyncio.sleep(0)
        self._at = max(self._at, sent)
        return True

    async def _on_echo(self, msg: Msg) -> None:
        answered = self._waiting.get(msg.data)  # a given-up round trip's echo, come late, answers nothing
        if answered is not None and not answered.done():
            answered.set_result(None)

    async def _run(self) -> None:
        while True:
            try:
                await self.round_trip()
            except Exception:  # a clock that stopped would never judge a peer dead again: keep it going
                log.exception("NATS round trip failed")
            await asyncio.sleep(self._interval_s)
