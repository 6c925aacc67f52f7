"""One request's inbox at the gateway: TextDeltas reordered by `seq`, duplicates dropped, and only those of
the scheduler instance that admitted it kept (a retried admission may have reached a second instance)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Callable

from kubesgl.errors import KubesglError
from kubesgl.protocol import ErrorInfo, TextDelta
from kubesgl.runtime.loop_local import LoopLocal

TICK_S = 0.5  # how often a waiting stream is woken with nothing, for its caller's periodic checks


class _Ticker:
    """Wakes every stream of one event loop that waits for a delta, each TICK_S: one timer for all of them. A
    timer per wait (asyncio.timeout) cost ~3.5 µs per delta of the gateway's CPU, where most waits end with a delta
    within milliseconds. Runs while some stream waits; a later wait starts it again."""

    def __init__(self) -> None:
        self.waiting: set[RequestStream] = set()
        self._task: asyncio.Task[None] | None = None

    def add(self, stream: RequestStream) -> None:
        """`stream` waits until `discard` (plain calls, not a context manager: this is once per delta)."""
        self.waiting.add(stream)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, stream: RequestStream) -> None:
        self.waiting.discard(stream)

    async def _run(self) -> None:
        while self.waiting:
            await asyncio.sleep(TICK_S)
            for stream in list(self.waiting):
                stream.wake()


_tickers = LoopLocal(_Ticker)


class RequestStream:
    def __init__(self, rid: str) -> None:
        self.rid = rid
        self.instance_id: str | None = None
        self._next_seq = 0
        self._held: dict[str, dict[int, TextDelta]] = {}  # out-of-order deltas, per sending instance
        self._ready: deque[TextDelta] = deque()  # in order, for next()
        self._waiter: asyncio.Future[None] | None = None  # next()'s, while it waits
        self._sink: Callable[[TextDelta], bool] | None = None  # set_sink's
        self._gap_since: float | None = (
            None  # monotonic time a later delta arrived while `_next_seq` is missing
        )

    def adopt(self, instance_id: str) -> list[str]:
        """The Admitted reply named `instance_id`; returns the other instances that sent deltas (to abort)."""
        self.instance_id = instance_id
        others = [i for i in self._held if i != instance_id]
        for other in others:
            del self._held[other]
        self._release()
        return others

    def offer(self, delta: TextDelta) -> bool:
        """Takes a delta; False when it came from an instance other than the adopted one. An error from a stage
        before any scheduler (empty instance_id) is taken at once."""
        if delta.instance_id and self.instance_id is not None and delta.instance_id != self.instance_id:
            return False
        if delta.error is not None and (not delta.instance_id or delta.instance_id == self.instance_id):
            self._push(delta)  # an error ends the request whatever came before it
            return True
        if delta.seq >= self._next_seq:
            if delta.seq == self._next_seq and delta.instance_id == self.instance_id:
                self._next_seq += 1
                self._push(delta)  # the next one goes straight through: only later ones wait in `_held`
            else:
                self._held.setdefault(delta.instance_id, {}).setdefault(delta.seq, delta)
            self._release()
        return True

    def fail(self, err: KubesglError) -> None:
        """Ends the request here with `err` (the gateway found its output lost)."""
        self._push(
            TextDelta(rid=self.rid, instance_id="", seq=-1, text="", finished=True, error=ErrorInfo.of(err))
        )

    def gap_age(self) -> float:
        """Seconds the stream has been stuck on a missing delta while later ones wait (0 when not stuck)."""
        return 0.0 if self._gap_since is None else time.monotonic() - self._gap_since

    async def next(self, timeout: float) -> TextDelta | None:
        """The next in-order delta, or None when none came: after `timeout` seconds if that is under TICK_S, else
        at the loop's next tick (within TICK_S: a caller's periodic checks and deadline are timed by the clock,
        and a deadline under TICK_S away gets its own timer, so it is never overshot)."""
        if not self._ready:  # under load one is usually here already: no timer, no task
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                if timeout < TICK_S:
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(timeout):
                            await self._waiter
                else:
                    ticker = _tickers.get()
                    ticker.add(self)
                    try:
                        await self._waiter
                    finally:
                        ticker.discard(self)
            finally:
                self._waiter = None
            if not self._ready:
                return None
        return self._pop()

    def wake(self) -> None:
        """Ends a wait with nothing (the ticker's turn)."""
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def next_ready(self) -> TextDelta | None:
        """The next in-order delta if it is here already and carries no error (an error has a turn of its own);
        else None. What a stream that fell behind takes into the event it is writing."""
        if self._ready and self._ready[0].error is None:
            return self._pop()
        return None

    def set_sink(self, sink: Callable[[TextDelta], bool] | None) -> None:
        """From now on, each in-order delta that arrives while none is queued goes to `sink` as it arrives (in
        the bus's delivery, not in the caller's task); `sink` returns False to decline one, which is then queued
        for next() as without a sink (and so is every later one until the queue is empty again). None: no sink."""
        self._sink = sink

    def _push(self, delta: TextDelta) -> None:
        sink = self._sink
        if sink is not None and not self._ready and sink(delta):
            return
        self._ready.append(delta)
        self.wake()

    def _pop(self) -> TextDelta:
        return self._ready.popleft()

    def _release(self) -> None:
        if self.instance_id is None:
            return
        held = self._held.get(self.instance_id)
        while held and self._next_seq in held:
            self._push(held.pop(self._next_seq))
            self._next_seq += 1
        if not held:
            self._gap_since = None
        elif self._gap_since is None:
            self._gap_since = time.monotonic()
