"""RequestStream: the gateway's per-request inbox (ordering by seq, duplicates, instance adoption, gaps)."""

from __future__ import annotations

import asyncio
import time

from kubesgl.errors import ServiceUnavailableError
from kubesgl.protocol import ErrorInfo, TextDelta
from kubesgl.services.gateway import request_stream
from kubesgl.services.gateway.request_stream import TICK_S, RequestStream


def _d(seq: int, instance: str = "a", **kw: object) -> TextDelta:
    return TextDelta(rid="r", instance_id=instance, seq=seq, text=str(seq), **kw)  # type: ignore[arg-type]


async def _drain(stream: RequestStream) -> list[str]:
    out = []
    while (d := await stream.next(0.01)) is not None:
        out.append(d.text)
    return out


async def test_deltas_wait_for_adoption_then_come_in_seq_order_without_duplicates() -> None:
    s = RequestStream("r")
    for seq in (1, 0, 1, 2):
        assert s.offer(_d(seq))
    assert await _drain(s) == []  # not adopted yet: the Admitted reply names the instance
    assert s.adopt("a") == []
    assert await _drain(s) == ["0", "1", "2"]
    s.offer(_d(0))
    s.offer(_d(3))
    assert await _drain(s) == ["3"]


async def test_adoption_drops_and_names_other_instances() -> None:
    s = RequestStream("r")
    s.offer(_d(0, "b"))
    s.offer(_d(0, "a"))
    assert s.adopt("a") == ["b"]
    assert not s.offer(_d(1, "b"))
    assert await _drain(s) == ["0"]


async def test_a_gap_is_measured_until_it_fills() -> None:
    s = RequestStream("r")
    s.adopt("a")
    s.offer(_d(1))
    assert s.gap_age() > 0
    s.offer(_d(0))
    assert s.gap_age() == 0 and await _drain(s) == ["0", "1"]


async def test_errors_and_failures_skip_the_queue() -> None:
    s = RequestStream("r")
    s.adopt("a")
    s.offer(_d(5, error=ErrorInfo(status=500, type="internal_error", message="boom")))
    s.fail(ServiceUnavailableError("lost"))
    first, second = await s.next(0.01), await s.next(0.01)
    assert first is not None and first.error.message == "boom"
    assert second is not None and second.error.message == "lost" and second.finished


async def test_a_long_wait_ends_at_a_delta_or_at_the_shared_tick_and_the_ticker_stops_when_idle() -> None:
    """Waits of TICK_S or more have no timer of their own: a delta ends them at once, else the loop's one ticker
    wakes every waiting stream with nothing within TICK_S (their callers' checks run on the clock); with nobody
    waiting the ticker's task ends."""
    streams = [RequestStream(f"r{i}") for i in range(50)]
    for s in streams:
        s.adopt("a")
    start = time.monotonic()
    waits = [asyncio.ensure_future(s.next(60.0)) for s in streams]
    await asyncio.sleep(0.01)
    ticker = request_stream._tickers.get()
    assert ticker.waiting == set(streams)
    streams[0].offer(TextDelta(rid="r0", instance_id="a", seq=0, text="x"))
    first = await asyncio.wait_for(waits[0], 1)
    assert first is not None and first.text == "x" and time.monotonic() - start < TICK_S
    assert await asyncio.gather(*waits[1:]) == [None] * 49
    # the tick, not the 60 s asked for (with slack for a loaded box)
    assert time.monotonic() - start < TICK_S + 2.0
    await asyncio.sleep(TICK_S + 0.1)
    assert not ticker.waiting and ticker._task is not None and ticker._task.done()


async def test_a_wait_shorter_than_the_tick_keeps_its_own_timer() -> None:
    s = RequestStream("r")
    s.adopt("a")
    start = time.monotonic()
    assert await s.next(0.05) is None
    assert 0.04 < time.monotonic() - start < TICK_S
