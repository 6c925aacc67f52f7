"""The scheduler instance's NATS side (rank 0, asyncio): admission, aborts, stats, heartbeats, delta delivery,
deadlines and drain. The engine runs on its own thread (engine_loop.py); this side never blocks it.

Admission replies only after engine.add_request succeeded, so an Admitted means the engine has the request.
A known rid is acknowledged again (the tokenizer and gateway retry with the same rid). Each engine step's
deltas go to the detokenizer queue group as TokenDeltaBatch requests of at most `detok_batch_size` deltas, all
in flight at once so the queue group spreads one step over several replicas; each is retried until acked
(delivery.py: at-least-once; the gateway drops duplicates by seq): a few NATS round trips per step, not one per
request. Per request one delta is in flight at a time; tokens produced meanwhile ride in its next delta, sent
when the batch holding the current one is acked. `stream_interval` (SGLang's --stream-interval) holds a request's
tokens back until that many are new (its first and last go at once): fewer, larger deltas at every hop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from itertools import pairwise

import nats.errors
from kubesgl.engine.scheduler.disagg import DisaggregationMode
from kubesgl.errors import DeadlineExceededError, InvalidRequestError, KubesglError, ServiceUnavailableError
from kubesgl.protocol import (
    ABORT,
    HEADER_RID,
    HEARTBEAT,
    HEARTBEAT_INTERVAL_S,
    Abort,
    Admitted,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    ProtocolError,
    SchedulerStats,
    TextDelta,
    TokenDelta,
    TokenDeltaBatch,
    check_ids,
    gateway_subject,
    generate_subject,
    headers,
    stats_subject,
)
from kubesgl.runtime.lifecycle import TaskGroup
from kubesgl.runtime.nats_conn import close
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.services.scheduler.delivery import deliver
from kubesgl.services.scheduler.engine_loop import AbortRequest, AddRequest, EngineLoop, QueryStats
from kubesgl.services.scheduler.engine_process import EngineProcess
from kubesgl.services.scheduler.kv_publisher import KvPublisher
from kubesgl.services.scheduler.pd import PdHook
from kubesgl.services.scheduler.streams import RequestStream
from kubesgl.values.outputs import EngineStats, ModelInfo, RequestOutput
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.scheduler")

_RECENT_RIDS = 10_000  # finished rids remembered so a late retry of their admission is acked, not rerun
_DEADLINE_GRACE_S = 2.0  # past its deadline the gateway has given up; after this grace, we do too
_BATCH_HEADROOM_BYTES = 1024  # a TokenDeltaBatch stays this far under the server's max_payload
# Deltas per TokenDeltaBatch (--detok-batch-size): 256 running requests are one batch for each of the chart's two
# detokenizers, and each batch costs a message to every gateway holding its requests (64 until 2026-12-07).
DETOK_BATCH_SIZE = 128


class SchedulerService:
    def __init__(
        self,
        nc: Client,
        instance_id: str,
        model: str,
        max_running_requests: int,
        max_queued_requests: int,
        make_engine_loop: Callable[[SchedulerService], EngineLoop | EngineProcess],
        stop: asyncio.Event,
        detok_timeout_s: float = 1.0,
        delivery_give_up_s: float = 30.0,
        kv_event_block_size: int = 0,
        detok_batch_size: int = DETOK_BATCH_SIZE,
        stream_interval: int = 1,
        pd: PdHook | None = None,  # a prefill or decode role (--disaggregation-mode); None: both
    ) -> None:
        self.pd = pd
        if detok_batch_size < 1:
            raise ValueError(f"detok_batch_size must be >= 1, got {detok_batch_size}")
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be >= 1, got {stream_interval}")
        self.nc = nc
        self.instance_id = instance_id
        self.model = model
        self.max_running_requests = max_running_requests
        self.max_queued_requests = max_queued_requests
        self.detok_timeout_s = detok_timeout_s
        self.delivery_give_up_s = delivery_give_up_s
        self.detok_batch_size = detok_batch_size
        self.stream_interval = stream_interval
        self.exit_code = 0
        self._stop = stop
        self._loop = asyncio.get_running_loop()
        self._tasks = TaskGroup()
        self._engine = make_engine_loop(self)
        if self.pd is not None:
            self.pd.submit = self._engine.submit
        self._info: ModelInfo | None = None
        self._loaded = asyncio.Event()
        self._heartbeat_sent = False
        self._draining = False
        self._streams: dict[str, RequestStream] = {}
        self._admissions: dict[str, asyncio.Future[KubesglError | None]] = {}
        self._recent: OrderedDict[str, int] = OrderedDict()  # rid -> prompt_tokens
        self._aborted: OrderedDict[str, None] = OrderedDict()  # aborts of rids not (yet) seen here
        self._in_flight: set[str] = set()  # rids whose latest delta is in a batch not acked yet
        self._deliveries: set[asyncio.Task[None]] = set()
        self._subs: list[Subscription] = []
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._kv = (
            KvPublisher(nc, instance_id, kv_event_block_size, self._engine.submit, self._loaded)
            if kv_event_block_size > 0
            else None
        )

    @property
    def telemetry(self) -> SchedulerTelemetry:
        telemetry = self._engine.telemetry
        assert telemetry is not None, "used only once the model is loaded"
        return telemetry

    # -- engine thread callbacks (called on the engine thread; hop to the event loop) -----------------
    def engine_loaded(self, info: ModelInfo) -> None:
        self._loop.call_soon_threadsafe(self._on_loaded, info)

    def engine_outputs(self, outputs: list[RequestOutput], parents: dict[str, str | None]) -> None:
        self._loop.call_soon_threadsafe(self._on_outputs, outputs, parents)

    def engine_kv_events(self, stored: list[int], removed: list[int]) -> None:
        if self._kv is not None:
            self._kv.engine_events(stored, removed)

    def engine_failed(self, error: BaseException) -> None:
        self._loop.call_soon_threadsafe(self._on_engine_failed, error)

    # -- lifecycle --------------------------------------------------------------------------------
    async def start(self) -> None:
        self._engine.start()
        self._subs = [
            await self.nc.subscribe(generate_subject(self.instance_id), cb=self._on_generate),
            await self.nc.subscribe(ABORT, cb=self._on_abort),
            await self.nc.subscribe(stats_subject(self.instance_id), cb=self._on_stats),
        ]
        if self._kv is not None:
            await self._kv.start()
        if self.pd is not None:
            await self.pd.start()
        self._heartbeat_task = self._loop.create_task(self._heartbeats())

    def nats_reconnected(self) -> None:
        if self._engine.telemetry is not None:  # the scheduler's metrics exist once the model is loaded
            self.telemetry.metrics.nats.on_reconnect()

    def ready(self) -> bool:
        return self.nc.is_connected and self._heartbeat_sent and not self._draining

    async def drain(self, timeout_s: float) -> None:
        """Stops admitting, finishes in-flight requests within `timeout_s`, aborts the rest, exits."""
        self._draining = True
        log.info("draining: %d request(s) in flight, grace %.0f s", len(self._streams), timeout_s)
        if self._loaded.is_set():
            await self._publish_heartbeat()
        end = time.monotonic() + timeout_s
        while self._streams and time.monotonic() < end:
            await asyncio.sleep(0.05)
        for rid in list(self._streams):
            await self._abandon(
                rid,
                ServiceUnavailableError(
                    f"scheduler instance {self.instance_id} shut down before the request finished "
                    f"(drain grace {timeout_s:.0f} s); retry the request"
                ),
            )
        if self._heartbeat_task is not None:
            self._heartbeat_task.cancel()
        if self._kv is not None:
            await self._kv.stop()
        await asyncio.to_thread(self._engine.stop, 60.0)
        await self._tasks.wait(2.0)
        for task in list(self._deliveries):
            task.cancel()
        await close(self.nc)

    # -- admission --------------------------------------------------------------------------------
    async def _on_generate(self, msg: Msg) -> None:
        self._tasks.spawn(self._admit(msg))

    async def _admit(self, msg: Msg) -> None:
        rid = (msg.headers or {}).get(HEADER_RID, "")
        try:
            req = GenerateRequest.from_bytes(msg.data)
            rid = req.rid
            reply: Admitted | ErrorReply = await self._add(req, msg.headers)
        except ProtocolError as e:
            reply = ErrorReply.from_error(rid, InvalidRequestError(str(e)))
        except KubesglError as e:
            reply = ErrorReply.from_error(rid, e)
        if msg.reply:
            await msg.respond(reply.to_bytes())

    async def _add(self, req: GenerateRequest, hdrs: dict[str, str] | None) -> Admitted:
        admitted = Admitted(rid=req.rid, instance_id=self.instance_id, prompt_tokens=len(req.input_ids))
        if req.rid in self._admissions:  # a retry while the first attempt is still being added
            err = await asyncio.shield(self._admissions[req.rid])
            if err is not None:
                raise err
            return admitted
        if req.rid in self._streams or req.rid in self._recent:
            return admitted
        check_ids(req.rid, req.gateway_id)
        if req.rid in self._aborted:
            raise InvalidRequestError(f"request {req.rid} was aborted before it was admitted")
        if self._draining:
            raise ServiceUnavailableError(f"scheduler instance {self.instance_id} is draining")
        if not self._loaded.is_set():
            raise ServiceUnavailableError(f"scheduler instance {self.instance_id} is still loading the model")
        if req.deadline <= time.time():
            raise DeadlineExceededError("the request's deadline passed before it reached a scheduler")
        queued = len(self._streams) - self.max_running_requests
        if queued >= self.max_queued_requests:
            raise ServiceUnavailableError(
                f"scheduler instance {self.instance_id} is full ({queued} requests queued); retry later"
            )
        stream = RequestStream(
            req.rid,
            req.gateway_id,
            req.deadline,
            len(req.input_ids),
            output_ids=list(req.output_ids),
            wants_logprobs=req.sampling.logprobs is not None,
            interval=self.stream_interval,
            sent=len(req.output_ids),
            resumed=len(req.output_ids),
        )
        # Registered before the engine sees the request, so its first outputs always find the stream.
        self._streams[req.rid] = stream
        future: asyncio.Future[KubesglError | None] = self._loop.create_future()
        self._admissions[req.rid] = future
        self.telemetry.on_arrival(req.rid, hdrs, len(req.input_ids))

        def done(err: KubesglError | None) -> None:
            self._loop.call_soon_threadsafe(future.set_result, err)

        # The engine checks the sampling parameters (the second gate after the gateway's): a refusal is a 400.
        if (
            self.pd is not None
            and req.prefill_instance
            and not req.output_ids
            and self.pd.mode is DisaggregationMode.DECODE
        ):
            self._engine.submit(self.pd.admit(req, done))
        else:
            self._engine.submit(AddRequest(req.rid, req.input_ids, req.sampling, done, req.output_ids))
        try:
            err = await future
        finally:
            del self._admissions[req.rid]
        if err is not None:
            self._streams.pop(req.rid, None)
            self.telemetry.on_abort(req.rid)
            raise err
        return admitted

    # -- aborts and stats -------------------------------------------------------------------------
    async def _on_abort(self, msg: Msg) -> None:
        try:
            abort = Abort.from_bytes(msg.data)
        except ProtocolError as e:
            log.warning("ignoring malformed abort: %s", e)
            return
        if abort.instance_id not in (None, self.instance_id):
            return
        stream = self._streams.pop(abort.rid, None)
        if stream is not None:
            stream.abandoned = True
            self._remember(stream)
            self._engine.submit(AbortRequest(abort.rid))
        elif abort.rid not in self._recent:
            # The abort overtook its own admission (client gone right after sending): refuse it when it comes.
            self._aborted[abort.rid] = None
            while len(self._aborted) > _RECENT_RIDS:
                self._aborted.popitem(last=False)

    async def _on_stats(self, msg: Msg) -> None:
        self._tasks.spawn(self._reply_stats(msg))

    async def _reply_stats(self, msg: Msg) -> None:
        if not self._loaded.is_set():
            reply = ErrorReply.from_error("", ServiceUnavailableError("model still loading"))
            await msg.respond(reply.to_bytes())
            return
        future: asyncio.Future[EngineStats] = self._loop.create_future()
        self._engine.submit(QueryStats(lambda s: self._loop.call_soon_threadsafe(future.set_result, s)))
        s = await future
        reply = SchedulerStats(
            instance_id=self.instance_id,
            running=s.num_running,
            queued=s.num_queued,
            free_pages=s.free_pages,
            available_pages=s.available_pages,
            total_pages=s.total_pages,
            cached_prefix_pages=s.cached_prefix_pages,
            active_rids=sorted(self._streams),
            draining=self._draining,
        )
        await msg.respond(reply.to_bytes())

    # -- outputs -> deltas ------------------------------------------------------------------------
    def _on_outputs(self, outputs: list[RequestOutput], parents: dict[str, str | None]) -> None:
        streams = []
        for out in outputs:
            stream = self._streams.get(out.rid)
            if stream is None:
                continue  # aborted or abandoned here: its final engine output has nowhere to go
            if out.error is not None:  # failed inside the engine (its grammar did not compile)
                self._tasks.spawn(self._abandon(out.rid, out.error))
                continue
            stream.add(out, parents.get(out.rid))
            streams.append(stream)
        self._send(streams)

    def _send(self, streams: Iterable[RequestStream]) -> None:
        """Sends the next delta of each stream that has none in flight, in the fewest TokenDeltaBatches of at
        most `detok_batch_size` deltas (more only past the NATS payload limit), all in flight at once."""
        sending: dict[str, RequestStream] = {}
        deltas = []
        for stream in streams:
            if stream.rid in self._in_flight:
                continue  # its tokens ride in the delta sent once the in-flight one is acked
            delta = stream.next_delta(self.instance_id)
            if delta is not None:
                sending[stream.rid] = stream
                deltas.append(delta)
        if not deltas:
            return
        self._in_flight.update(sending)
        max_bytes = self.nc.max_payload - _BATCH_HEADROOM_BYTES
        for chunk in _even_chunks(deltas, self.detok_batch_size):
            for group, body in TokenDeltaBatch.pack(chunk, max_bytes):
                task = self._loop.create_task(self._deliver([sending[d.rid] for d in group], body))
                self._deliveries.add(task)
                task.add_done_callback(self._deliveries.discard)

    async def _deliver(self, streams: list[RequestStream], batch: bytes) -> None:
        """Delivers one batch; then ends the streams it finished and sends what the others produced meanwhile."""
        try:
            ack = await deliver(
                self.nc,
                batch,
                len(streams),
                self.telemetry.metrics.nats,
                self.detok_timeout_s,
                self.delivery_give_up_s,
            )
        finally:
            self._in_flight.difference_update(s.rid for s in streams)
        if ack is None:
            refused = set(range(len(streams)))
        else:
            refused = {i for i in ack.refused if 0 <= i < len(streams)}
            for i in refused:
                log.error("detokenizer refused the delta of %s: %s", streams[i].rid, ack.refused[i])
        delivered = [s for i, s in enumerate(streams) if i not in refused]
        # No await until these are sent on: a stream counts as done only once its final delta is acked.
        for stream in delivered:
            if stream.done and self._streams.get(stream.rid) is stream:
                self._streams.pop(stream.rid)
                self._remember(stream)
        self._send(delivered)
        for i in refused:
            await self._abandon(
                streams[i].rid,
                ServiceUnavailableError("no detokenizer acknowledged the request's output; retry"),
            )

    async def _abandon(self, rid: str, err: KubesglError) -> None:
        """Ends a request here: frees it in the engine and tells its gateway why, directly."""
        stream = self._streams.pop(rid, None)
        if stream is None:
            return
        self._engine.submit(AbortRequest(rid))
        self._remember(stream)
        delta: TextDelta = stream.abandon(self.instance_id, err)
        try:
            await self.nc.publish(gateway_subject(stream.gateway_id), delta.to_bytes(), headers=headers(rid))
        except nats.errors.Error as e:
            log.warning("could not tell gateway %s that %s failed: %s", stream.gateway_id, rid, e)

    def _remember(self, stream: RequestStream) -> None:
        self._recent[stream.rid] = stream.prompt_tokens
        while len(self._recent) > _RECENT_RIDS:
            self._recent.popitem(last=False)

    # -- heartbeats, deadlines, engine state ------------------------------------------------------
    def _on_loaded(self, info: ModelInfo) -> None:
        self._info = info
        self._loaded.set()
        log.info(
            "model %s loaded: context %d, %d pages of %d tokens",
            self.model,
            info.context_len,
            info.num_pages,
            info.page_size,
        )

    def _on_engine_failed(self, error: BaseException) -> None:
        log.error(
            "engine failed (%s: %s); failing in-flight requests and exiting", type(error).__name__, error
        )
        self.exit_code = 1
        for rid in list(self._streams):
            self._tasks.spawn(self._abandon(rid, KubesglError(f"the scheduler's engine failed: {error}")))
        self._stop.set()

    async def _heartbeats(self) -> None:
        await self._loaded.wait()
        last = time.monotonic()
        while True:
            try:
                await self._publish_heartbeat()
                self._expire_deadlines()
            except Exception:  # a heartbeat missed is survivable; a heartbeat loop that died is not
                log.exception("heartbeat failed")
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)
            now = time.monotonic()
            if now - last > 2 * HEARTBEAT_INTERVAL_S:  # peers declare this instance dead at 3 intervals
                log.warning("heartbeat %.1f s late: this process's event loop was held up", now - last - 1)
            last = now

    async def _publish_heartbeat(self) -> None:
        info, stats = self._info, self._engine.stats
        assert info is not None and stats is not None
        self.telemetry.on_step(stats)
        hb = Heartbeat(
            instance_id=self.instance_id,
            model=self.model,
            context_len=info.context_len,
            page_size=info.page_size,
            num_pages=info.num_pages,
            running=stats.num_running,
            queued=stats.num_queued,
            free_pages=stats.free_pages,
            available_pages=stats.available_pages,
            max_running_requests=self.max_running_requests,
            draining=self._draining,
            ts=time.time(),
            kv_block_size=self._kv.block_size if self._kv else 0,
            kv_epoch=self._kv.epoch if self._kv else "",
            kv_seq=self._kv.seq if self._kv else 0,
            role=self.pd.mode.value if self.pd is not None else DisaggregationMode.BOTH.value,
        )
        try:
            await self.nc.publish(HEARTBEAT, hb.to_bytes())
            self._heartbeat_sent = True
        except nats.errors.Error as e:
            log.warning("heartbeat not sent: %s", e)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, stream in list(self._streams.items()):
            if now > stream.deadline + _DEADLINE_GRACE_S and rid not in self._admissions:
                self._tasks.spawn(self._abandon(rid, DeadlineExceededError("the request's deadline passed")))


def _even_chunks(deltas: list[TokenDelta], cap: int) -> list[list[TokenDelta]]:
    """`deltas` in order, cut into the fewest chunks of at most `cap`, evenly (65 with cap 64 make 33 + 32),
    so the replicas sharing a step finish their parts at about the same time."""
    n = -(-len(deltas) // cap)
    cuts = [len(deltas) * i // n for i in range(n + 1)]
    return [deltas[a:b] for a, b in pairwise(cuts)]
