"""The time up to which a process has read everything NATS sent it: the clock to judge a peer's silence by.

A process that falls behind (CPU-starved, its event loop busy) has its peers' heartbeats waiting unread in its
socket; judged by the wall clock every peer then looks silent, and a gateway would migrate the streams of a live
scheduler. This clock advances only when a PING/PONG round trip to the server (nats-py's flush) comes back:
every message the server sent before that PING has been read by then and handed to its subscription, whose
callback runs in the next turns of the loop. Silence measured against it is the peer's own, never the reader's
lag; while the connection is down it stands still (an outage is nobody's death).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import nats.errors
from nats.aio.client import Client

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

    def __call__(self) -> float:
        return self._at

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def round_trip(self) -> bool:
        """One round trip; True (and the clock at its start) when the server answered."""
        sent = self._clock()
        try:
            await self._nc.flush(timeout=max(1, int(10 * self._interval_s)))
        except (nats.errors.Error, TimeoutError):
            return False
        for _ in range(2):  # the subscriptions' tasks take what came before the PONG
            await asyncio.sleep(0)
        self._at = max(self._at, sent)
        return True

    async def _run(self) -> None:
        while True:
            try:
                await self.round_trip()
            except Exception:  # a clock that stopped would never judge a peer dead again: keep it going
                log.exception("NATS round trip failed")
            await asyncio.sleep(self._interval_s)
