"""HeardClock over a real nats-server: a reader that fell behind (its event loop held for longer than the
heartbeat expiry while a live peer kept heartbeating) does not take its own lag for the peer's death, where the
wall clock does; a peer that really went silent is declared dead once the reader has caught up."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest
from kubesgl.protocol import HEARTBEAT, Heartbeat
from kubesgl.routing import SchedulerRegistry
from kubesgl.runtime.heard_clock import HeardClock
from kubesgl.runtime.nats_server import NatsServer
from nats.aio.msg import Msg

EXPIRY_S = 1.0
BEAT_S = 0.1  # scenario timing: the peer's heartbeat period, well inside the expiry


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = NatsServer(Path(tmp_path_factory.mktemp("nats")))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


class _Peer:
    """A live scheduler instance as far as heartbeats go: its own thread, event loop and connection."""

    def __init__(self, url: str) -> None:
        self.beating = threading.Event()
        self.beating.set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=asyncio.run, args=(self._run(url),), daemon=True)
        self._thread.start()

    async def _run(self, url: str) -> None:
        nc = await nats.connect(url)
        hb = Heartbeat("peer", "m", 4096, 1, 100, 0, 0, 100, 100, 8, False, 0.0)
        while not self._done.is_set():
            if self.beating.is_set():
                await nc.publish(HEARTBEAT, hb.to_bytes())
                await nc.flush()
            await asyncio.sleep(BEAT_S)
        await nc.close()

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


async def test_a_reader_behind_its_socket_keeps_a_live_peer_and_drops_a_silent_one(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    heard = HeardClock(nc)
    judged, walled = SchedulerRegistry(EXPIRY_S), SchedulerRegistry(EXPIRY_S)
    judged.judge_at(heard)

    async def on_heartbeat(msg: Msg) -> None:
        hb = Heartbeat.from_bytes(msg.data)
        judged.observe(hb)
        walled.observe(hb)

    await nc.subscribe(HEARTBEAT, cb=on_heartbeat)
    heard.start()
    peer = _Peer(nats_url)
    try:
        deadline = time.monotonic() + 10
        while not judged.live() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert [hb.instance_id for hb in judged.live()] == ["peer"]
        before = heard()

        time.sleep(2 * EXPIRY_S)  # this reader's loop is held; the peer's heartbeats pile up in its socket
        # Right after: nothing read yet. By the wall clock the live peer looks dead; by what was read, not.
        assert walled.live() == []
        assert [hb.instance_id for hb in judged.live()] == ["peer"]
        assert await heard.round_trip() and heard() > before + 2 * EXPIRY_S - 0.1
        assert [hb.instance_id for hb in judged.live()] == ["peer"]  # the backlog was read first

        peer.beating.clear()  # now it really goes silent
        silenced = time.monotonic()
        while judged.live() and time.monotonic() - silenced < 10:
            await asyncio.sleep(0.05)
        assert judged.live() == [] and time.monotonic() - silenced < EXPIRY_S + 2
    finally:
        peer.stop()
        await heard.stop()
        await nc.close()


@pytest.mark.parametrize("how", ["stopped", "timed out"])
async def test_a_round_trip_given_up_leaves_the_connection_reading(nats_url: str, how: str) -> None:
    """A round trip abandoned before its answer came (the clock stopped at shutdown, or a round trip that timed
    out behind a busy loop) must not break the connection: nats-py's flush left a cancelled future for the late
    PONG, whose set_result raised in the read loop and ended it, so the process heard nothing more (found in a
    gateway's log at shutdown: 'nats: encountered error ... InvalidStateError')."""
    nc = await nats.connect(nats_url)
    try:
        clock = HeardClock(nc, interval_s=0.05)
        if how == "stopped":
            clock.start()
            await asyncio.sleep(0)  # its first PING is on its way, the PONG not read yet
            await clock.stop()
        else:
            assert not await clock.round_trip(timeout_s=0)  # given up before its answer could come
        await asyncio.sleep(0.3)  # the late answer is read
        sub = await nc.subscribe("heard.check")
        await nc.publish("heard.check", b"still reading")
        msg = await sub.next_msg(timeout=3)
        assert msg.data == b"still reading"
        assert await clock.round_trip()
        await clock.stop()
    finally:
        await nc.close()
