"""Publishes this instance's prefix-cache KV events for routers, and answers their snapshot requests.

The engine thread drains the radix cache's events after every step and hands them here (on the event loop).
They are coalesced into numbered batches (`seq` from 1 per process `epoch`), at most one publish per
`min_interval_s`, on kv_events_subject(instance). A router that starts late, reconnects or sees a seq gap asks
kv_snapshot_subject(instance): the engine thread drains pending events and lists every cached block at one
point between steps; the batch holding everything drained before that point is cut at once, so the snapshot
is exactly "as of batch seq" and a router ignores batches up to seq and applies the later ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

import nats.errors
from kubesgl.cache_routing.kv_batch import KvBatch
from kubesgl.errors import ServiceUnavailableError
from kubesgl.protocol import ErrorReply, KvEvents, KvSnapshot, kv_events_subject, kv_snapshot_subject
from kubesgl.services.scheduler.engine_loop import Command, KvSnapshotQuery
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.scheduler.kv")


class KvPublisher:
    def __init__(
        self,
        nc: Client,
        instance_id: str,
        block_size: int,
        submit: Callable[[Command], None],
        loaded: asyncio.Event,
        min_interval_s: float = 0.02,
    ) -> None:
        self.nc = nc
        self.instance_id = instance_id
        self.block_size = block_size
        self.epoch = uuid.uuid4().hex[:16]  # a restart under the same instance id is a new stream
        self.seq = 0  # the last batch cut (announced in heartbeats)
        self.min_interval_s = min_interval_s
        self._submit = submit
        self._loaded = loaded
        self._loop = asyncio.get_running_loop()
        self._batch = KvBatch()
        self._outbox: list[KvEvents] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(kv_snapshot_subject(self.instance_id), cb=self._on_snapshot)
        self._task = self._loop.create_task(self._publish_loop())

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):  # a connection that is down has nothing to unsubscribe
                await self._sub.unsubscribe()
        if self._task is not None:
            self._task.cancel()

    def engine_events(self, stored: list[int], removed: list[int]) -> None:
        """Called on the engine thread after a step that changed the cache."""
        self._loop.call_soon_threadsafe(self._add, stored, removed)

    def _add(self, stored: list[int], removed: list[int]) -> None:
        self._batch.add(stored, removed)
        self._wake.set()

    def _cut(self) -> None:
        if self._batch:
            stored, removed = self._batch.take()
            self.seq += 1
            self._outbox.append(
                KvEvents(self.instance_id, self.epoch, self.seq, self.block_size, stored, removed)
            )
            self._wake.set()

    async def _publish_loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._cut()
            while self._outbox:
                ev = self._outbox.pop(0)
                try:
                    await self.nc.publish(kv_events_subject(self.instance_id), ev.to_bytes())
                except nats.errors.Error as e:  # routers see the gap in seq and ask for a snapshot
                    log.warning("KV events batch %d not published: %s", ev.seq, e)
            await asyncio.sleep(self.min_interval_s)

    async def _on_snapshot(self, msg: Msg) -> None:
        if not self._loaded.is_set():
            reply = ErrorReply.from_error("", ServiceUnavailableError("model still loading"))
            await msg.respond(reply.to_bytes())
            return
        future: asyncio.Future[tuple[int, list[int]]] = self._loop.create_future()

        def ready(blocks: list[int]) -> None:  # on the loop, right after the events drained before it
            self._cut()
            future.set_result((self.seq, blocks))

        self._submit(KvSnapshotQuery(lambda blocks: self._loop.call_soon_threadsafe(ready, blocks)))
        seq, blocks = await future
        body = KvSnapshot(self.instance_id, self.epoch, seq, self.block_size, blocks).to_bytes()
        if len(body) > self.nc.max_payload:
            # Routers keep routing this instance by load; the operator can raise max_payload or the block size.
            message = (
                f"KV snapshot of {len(blocks)} blocks exceeds the NATS max_payload ({self.nc.max_payload} bytes);"
                " raise max_payload or --kv-event-block-size"
            )
            log.warning(message)
            body = ErrorReply.from_error("", ServiceUnavailableError(message)).to_bytes()
        with contextlib.suppress(nats.errors.Error):  # the requester retries on its next heartbeat
            await msg.respond(body)
