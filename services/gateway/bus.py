"""The gateway's side of the NATS mesh: admits requests through the tokenizer queue group (retrying with the
same rid, so a killed tokenizer loses nothing), receives every TextDelta for this gateway on one subscription (in TextDeltaBatches)
and hands each to its request's RequestStream, tracks scheduler heartbeats, and publishes aborts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from collections.abc import Coroutine
from typing import Any

import nats.errors
from kubesgl.errors import DeadlineExceededError, KubesglError, PayloadTooLargeError, ServiceUnavailableError
from kubesgl.protocol import (
    ABORT,
    HEARTBEAT,
    TOKENIZE,
    Abort,
    Admitted,
    ErrorReply,
    Heartbeat,
    ProtocolError,
    SchedulerStats,
    TokenizeRequest,
    decode,
    gateway_deltas,
    gateway_subject,
    headers,
    stats_subject,
)
from kubesgl.routing import SchedulerRegistry
from kubesgl.runtime.heard_clock import HeardClock
from kubesgl.runtime.telemetry.metrics import NatsMetrics
from kubesgl.services.gateway.migration import MigrationPolicy
from kubesgl.services.gateway.request_stream import RequestStream
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.gateway")

# After a reconnect: let resent deltas arrive before asking schedulers which requests they still run.
_AUDIT_DELAY_S = 2.0
# A request its scheduler no longer runs may still have its last delta in flight: wait this long for it.
_AUDIT_GRACE_S = 1.0
_AUDIT_ATTEMPTS = 5


class GatewayBus:
    def __init__(
        self,
        nc: Client,
        gateway_id: str,
        registry: SchedulerRegistry,
        metrics: NatsMetrics,
        attempt_timeout_s: float = 5.0,
        no_tokenizer_grace_s: float = 10.0,
    ) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.registry = registry
        self._metrics = metrics
        self._attempt_timeout_s = attempt_timeout_s
        self._no_tokenizer_grace_s = no_tokenizer_grace_s
        self._streams: dict[str, RequestStream] = {}
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._connected_since = time.monotonic()
        self._watch: asyncio.Task[None] | None = None
        self.migration = MigrationPolicy()  # what a choice whose instance died may do (app.py sets it)
        # Silence is judged on what this gateway has read (runtime.heard_clock), as the registry's is.
        self.heard = HeardClock(nc)
        registry.judge_at(self.heard)

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(gateway_subject(self.gateway_id), cb=self._on_delta),
            await self.nc.subscribe(HEARTBEAT, cb=self._on_heartbeat),
        ]
        self._watch = asyncio.get_running_loop().create_task(self._watch_connection())
        self.heard.start()

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
        await self.heard.stop()
        for sub in self._subs:
            await sub.unsubscribe()
        if self._tasks:
            _, pending = await asyncio.wait(self._tasks, timeout=2.0)
            for task in pending:
                task.cancel()

    @property
    def connected(self) -> bool:
        return self.nc.is_connected

    def scheduler_gone(self, instance_id: str, epoch: str = "") -> bool:
        """The instance stopped heartbeating while this gateway could hear it (a NATS outage is not its death),
        or, given the `epoch` it had, heartbeats with another one: a new process under the same id (a restarted
        pod), which knows nothing of the old one's requests."""
        return self.connected and self.registry.gone(instance_id, epoch, since=self._connected_since)

    def open(self, rid: str) -> RequestStream:
        """Registers the inbox before admission: the first delta can beat the Admitted reply."""
        stream = RequestStream(rid)
        self._streams[rid] = stream
        return stream

    def close(self, stream: RequestStream, abort: bool) -> None:
        """Forgets the request; `abort` tells every scheduler (a retried admission may have reached two) to stop
        it and free its pages. Synchronous, so it is safe in a cancelled task's `finally`."""
        self._streams.pop(stream.rid, None)
        if abort:
            self.abort(stream.rid, None)

    def fail_open(self, err: KubesglError) -> int:
        """Ends every open request with `err` (their schedulers are told to abort as each response closes);
        returns how many there were."""
        streams = list(self._streams.values())
        for stream in streams:
            stream.fail(err)
        return len(streams)

    def abort(self, rid: str, instance_id: str | None) -> None:
        self._spawn(self._publish(ABORT, Abort(rid=rid, instance_id=instance_id).to_bytes(), rid))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def admit(self, stream: RequestStream, req: TokenizeRequest, traceparent: str | None) -> Admitted:
        """Sends the request to a tokenizer until a scheduler admits or refuses it (raising the refusal)."""
        started = time.monotonic()
        backoff = 0.05
        hdrs = headers(req.rid, req.deadline, traceparent)
        body = req.to_bytes()
        if len(body) > self.nc.max_payload:  # NATS would refuse it: the client's answer, not a server fault
            raise PayloadTooLargeError(
                f"the request is {len(body)} bytes on the message bus, above its limit of {self.nc.max_payload}"
            )
        while True:
            remaining = req.deadline - time.time()
            if remaining <= 0:
                raise DeadlineExceededError("the request deadline passed before a scheduler admitted it")
            try:
                with self._metrics.request("tokenize"):
                    msg = await self.nc.request(
                        TOKENIZE, body, timeout=min(self._attempt_timeout_s, remaining), headers=hdrs
                    )
            except nats.errors.NoRespondersError:
                if time.monotonic() - started > self._no_tokenizer_grace_s:
                    raise ServiceUnavailableError("no tokenizer is available") from None
                await asyncio.sleep(min(backoff, max(0.0, req.deadline - time.time())))
                backoff = min(backoff * 2, 1.0)
                continue
            except nats.errors.TimeoutError:
                continue  # same rid again: a scheduler that already admitted it acknowledges again
            except (nats.errors.ConnectionClosedError, nats.errors.ConnectionDrainingError):
                raise ServiceUnavailableError("the gateway lost its NATS connection") from None
            reply = decode(msg.data, Admitted, ErrorReply)
            if isinstance(reply, ErrorReply):
                raise reply.to_error()
            for other in stream.adopt(reply.instance_id):
                self.abort(stream.rid, other)
            return reply

    async def _watch_connection(self) -> None:
        # Heartbeats missed while we were disconnected say nothing about the schedulers: restart the clock.
        # Watched through nats-py's reconnect count: a reconnect quicker than the poll interval still counts.
        seen = self.nc.stats["reconnects"]
        while True:
            await asyncio.sleep(0.25)
            if self.nc.stats["reconnects"] != seen and self.connected:
                seen = self.nc.stats["reconnects"]
                self._connected_since = time.monotonic()
                self._spawn(self._audit_after_reconnect())

    async def _audit_after_reconnect(self) -> None:
        """TextDeltas published while this gateway was disconnected are lost. A request whose scheduler no
        longer runs it would then wait out its timeouts: end it now with a clear error instead."""
        await asyncio.sleep(_AUDIT_DELAY_S)
        by_instance: dict[str, list[RequestStream]] = defaultdict(list)
        for stream in self._streams.values():
            if stream.instance_id is not None:
                by_instance[stream.instance_id].append(stream)
        for instance, streams in by_instance.items():
            active = await self._active_rids(instance)
            if active is None:
                continue  # unreachable: if it is gone, its missing heartbeats fail its requests
            lost = [s for s in streams if s.rid not in active]
            if lost:
                await asyncio.sleep(_AUDIT_GRACE_S)
            for stream in lost:
                if self._streams.get(stream.rid) is stream:
                    log.warning("request %s lost its output while NATS reconnected", stream.rid)
                    stream.fail(
                        ServiceUnavailableError("the request's output was lost while NATS reconnected")
                    )

    async def _active_rids(self, instance: str) -> set[str] | None:
        """The rids `instance` still runs; None if it does not answer (it may be reconnecting too)."""
        for _ in range(_AUDIT_ATTEMPTS):
            try:
                msg = await self.nc.request(stats_subject(instance), b"", timeout=2.0)
                return set(SchedulerStats.from_bytes(msg.data).active_rids)
            except nats.errors.NoRespondersError:
                await asyncio.sleep(1.0)
            except (nats.errors.Error, ProtocolError) as e:
                log.info("cannot audit requests on %s: %s", instance, e)
        return None

    async def _on_delta(self, msg: Msg) -> None:
        try:
            deltas = gateway_deltas(msg.data)
        except ProtocolError as e:
            log.warning("dropping a malformed TextDelta(Batch): %s", e)
            return
        for delta in deltas:
            stream = self._streams.get(delta.rid)
            if stream is not None and not stream.offer(delta):
                self.abort(delta.rid, delta.instance_id)  # a second instance runs it too: stop the copy

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            self.registry.observe(Heartbeat.from_bytes(msg.data))
        except ProtocolError as e:
            log.warning("dropping a malformed Heartbeat: %s", e)

    async def _publish(self, subject: str, body: bytes, rid: str) -> None:
        try:
            await self.nc.publish(subject, body, headers=headers(rid))
        except nats.errors.Error as e:
            log.warning("abort for %s not sent: %s", rid, e)
