"""Keeps this tokenizer replica's prefix index current: every instance's KV event batches, and a snapshot
whenever the tracker says it is out of sync (first sight of an instance, a seq gap, a restart, a reconnect).

Snapshots are requested at most once per `retry_s` per instance and never two at a time; until one arrives
the instance counts no overlap (routing by load), so a slow or failed snapshot costs hit rate, not errors.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable

import nats.errors
from kubesgl.cache_routing.kv_tracker import KvTracker
from kubesgl.protocol import (
    KV_EVENTS_ALL,
    ErrorReply,
    Heartbeat,
    KvEvents,
    KvSnapshot,
    ProtocolError,
    decode,
    kv_snapshot_subject,
)
from kubesgl.runtime.lifecycle import TaskGroup
from kubesgl.runtime.telemetry.metrics import RouterMetrics
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.tokenizer.kv")


class KvFeed:
    def __init__(
        self,
        nc: Client,
        tracker: KvTracker,
        metrics: RouterMetrics,
        wanted: Callable[[str], bool],
        snapshot_timeout_s: float = 2.0,
        retry_s: float = 1.0,
    ) -> None:
        self.nc = nc
        self.tracker = tracker
        self.metrics = metrics
        self._wanted = wanted  # live, non-draining instances of this tokenizer's model
        self.snapshot_timeout_s = snapshot_timeout_s
        self.retry_s = retry_s
        self._in_flight: set[str] = set()
        self._last_try: dict[str, float] = {}
        self._warned: set[str] = set()
        self._tasks = TaskGroup()
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self._sub = await self.nc.subscribe(KV_EVENTS_ALL, cb=self._on_events)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):  # a connection that is down has nothing to unsubscribe
                await self._sub.unsubscribe()
        await self._tasks.wait(0.5)

    def on_heartbeat(self, hb: Heartbeat) -> None:
        if hb.kv_block_size and not self.tracker.usable(hb) and hb.instance_id not in self._warned:
            self._warned.add(hb.instance_id)
            log.warning(
                "instance %s publishes KV events in blocks of %d tokens, this router hashes %d: routing it by "
                "load only (set the same --kv-event-block-size / --kv-block-size everywhere)",
                hb.instance_id,
                hb.kv_block_size,
                self.tracker.block_size,
            )
        if self.tracker.on_heartbeat(hb):
            self._want_snapshot(hb.instance_id)
        self._report()

    def retain(self, instance_ids: Iterable[str]) -> None:
        """Drops instances that are gone or draining from the index."""
        gone = self.tracker.retain(instance_ids)
        if gone:
            log.info("routing index: dropped %s", ", ".join(sorted(gone)))
            self._report()

    def forget(self, instance_id: str) -> None:
        self.tracker.forget(instance_id)
        self._report()

    async def _on_events(self, msg: Msg) -> None:
        try:
            ev = KvEvents.from_bytes(msg.data)
        except ProtocolError as e:
            log.warning("ignoring malformed KV events: %s", e)
            return
        if not self._wanted(ev.instance_id):
            return
        if self.tracker.on_events(ev):
            self._want_snapshot(ev.instance_id)
        self._report()

    def _want_snapshot(self, instance_id: str) -> None:
        now = time.monotonic()
        if instance_id in self._in_flight or now - self._last_try.get(instance_id, -1e9) < self.retry_s:
            return
        self._in_flight.add(instance_id)
        self._last_try[instance_id] = now
        self._tasks.spawn(self._snapshot(instance_id))

    async def _snapshot(self, instance_id: str) -> None:
        try:
            msg = await self.nc.request(
                kv_snapshot_subject(instance_id), b"", timeout=self.snapshot_timeout_s
            )
            reply = decode(msg.data, KvSnapshot, ErrorReply)
        except (nats.errors.Error, ProtocolError) as e:
            self.metrics.on_snapshot("error")
            log.info("KV snapshot of %s failed (%s); routing it by load meanwhile", instance_id, e)
            return
        finally:
            self._in_flight.discard(instance_id)
        if isinstance(reply, ErrorReply):
            self.metrics.on_snapshot("refused")
            log.info("KV snapshot of %s refused: %s", instance_id, reply.error.message)
            return
        if not self._wanted(instance_id):
            return  # gone or draining while the snapshot was on its way
        self.metrics.on_snapshot("ok")
        if self.tracker.on_snapshot(reply):
            self._want_snapshot(instance_id)
        self._report()

    def _report(self) -> None:
        index = self.tracker.index
        self.metrics.on_index({i: index.blocks_of(i) for i in index.instances()}, len(index))
