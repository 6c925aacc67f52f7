"""The tokenizer replica: takes TokenizeRequests from the "tokenizer" queue group, tokenizes, routes to a live
scheduler instance and relays that instance's admission reply (Admitted or ErrorReply) to the gateway.

A replica holds no per-request state, so any replica may die: the gateway retries a tokenize that timed out
with the same rid and schedulers treat a known rid as an idempotent admission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import nats.errors
from kubesgl.errors import (
    DeadlineExceededError,
    InvalidRequestError,
    KubesglError,
    ModelNotFoundError,
    ServiceUnavailableError,
)
from kubesgl.protocol import (
    HEADER_RID,
    HEARTBEAT,
    TOKENIZE,
    TOKENIZER_QUEUE,
    Admitted,
    ErrorReply,
    GenerateRequest,
    Heartbeat,
    PromptKind,
    ProtocolError,
    TokenizeRequest,
    check_ids,
    decode,
    generate_subject,
    headers,
)
from kubesgl.routing import SchedulerRegistry
from kubesgl.runtime.heard_clock import HeardClock
from kubesgl.runtime.lifecycle import TaskGroup
from kubesgl.runtime.nats_conn import close
from kubesgl.runtime.telemetry.metrics import TokenizerMetrics
from kubesgl.runtime.telemetry.tracing import (
    ATTR_MODEL,
    ATTR_RID,
    SPAN_TOKENIZE,
    Tracing,
    traceparent,
)
from kubesgl.services.tokenizer.kv_feed import KvFeed
from kubesgl.services.tokenizer.prompt import (
    check_context,
    model_tool_format,
    prompt_ids,
    tool_format_for,
    tool_sampling,
)
from kubesgl.services.tokenizer.request_router import RequestRouter
from kubesgl.text.tokenizer import ModelTokenizer
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.tokenizer")


class TokenizerService:
    exit_code = 0

    def __init__(
        self,
        nc: Client,
        tokenizer: ModelTokenizer,
        model: str,
        router: RequestRouter,
        registry: SchedulerRegistry,
        metrics: TokenizerMetrics,
        tracing: Tracing,
        admit_timeout_s: float = 4.0,
        attempt_timeout_s: float = 2.0,
        kv_feed: KvFeed | None = None,
    ) -> None:
        self.nc = nc
        self.tokenizer = tokenizer
        self.tool_format = model_tool_format(tokenizer)
        self.model = model
        self.router = router
        self.registry = registry
        self.heard = HeardClock(nc)  # silence is judged on what this service has read (runtime.heard_clock)
        registry.judge_at(self.heard)
        self.metrics = metrics
        self.tracing = tracing
        self.kv_feed = kv_feed  # cache-aware routing's view of every instance's prefix cache
        # The whole admission (all scheduler attempts) stays under the gateway's per-attempt timeout.
        self.admit_timeout_s = admit_timeout_s
        self.attempt_timeout_s = attempt_timeout_s
        self._tasks = TaskGroup()
        self._subs: list[Subscription] = []
        self._started = time.monotonic()
        # One thread: keeps the event loop free during long prompts, and HF tokenizers are not safe to call
        # concurrently ("Already borrowed"); replicas, not threads, scale tokenization.
        self._tokenize_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    async def start(self) -> None:
        self._subs = [
            await self.nc.subscribe(HEARTBEAT, cb=self._on_heartbeat),
            await self.nc.subscribe(TOKENIZE, queue=TOKENIZER_QUEUE, cb=self._on_tokenize),
        ]
        if self.kv_feed is not None:
            await self.kv_feed.start()
        self.heard.start()

    def nats_reconnected(self) -> None:
        self.metrics.nats.on_reconnect()

    def ready(self) -> bool:
        # Ready once it can route (heard a scheduler), or after the heartbeat expiry window regardless, so a
        # rollout of tokenizers never waits on schedulers.
        warm = bool(self.registry.live()) or time.monotonic() - self._started > self.registry.expiry_s
        return self.nc.is_connected and bool(self._subs) and warm

    async def drain(self, timeout_s: float) -> None:
        """Stops taking requests, finishes the ones in hand, then closes the connection."""
        for sub in reversed(self._subs):
            with contextlib.suppress(Exception):  # a connection that is down has nothing to drain
                await sub.unsubscribe()
        await self._tasks.wait(timeout_s)
        await self.heard.stop()
        if self.kv_feed is not None:
            await self.kv_feed.stop()
        self._tokenize_thread.shutdown(wait=False)
        await close(self.nc)

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = Heartbeat.from_bytes(msg.data)
        except ProtocolError as e:
            log.warning("ignoring malformed heartbeat: %s", e)
            return
        self.registry.observe(hb)
        if self.kv_feed is not None:
            if hb.model == self.model:
                self.kv_feed.on_heartbeat(hb)
            self.kv_feed.retain(c.instance_id for c in self.registry.candidates(self.model))

    async def _on_tokenize(self, msg: Msg) -> None:
        self._tasks.spawn(self._handle(msg))

    async def _handle(self, msg: Msg) -> None:
        rid = (msg.headers or {}).get(HEADER_RID, "")
        with self.metrics.requests.track() as status, self.tracing.span(SPAN_TOKENIZE, msg.headers) as span:
            try:
                req = TokenizeRequest.from_bytes(msg.data)
                rid = req.rid
                span.set_attributes({ATTR_RID: rid, ATTR_MODEL: req.model})
                reply = await self._admit(req, traceparent(span))
            except ProtocolError as e:
                reply = ErrorReply.from_error(rid, InvalidRequestError(str(e)))
            except KubesglError as e:
                reply = ErrorReply.from_error(rid, e)
            if reply is None:  # every scheduler was slow: stay silent, the gateway retries the same rid
                status.status = 504
                span.set_attribute("kubesgl.status", 504)
                return
            status.status = 200 if isinstance(reply, Admitted) else reply.error.status
            span.set_attribute("kubesgl.status", status.status)
            if msg.reply:
                await msg.respond(reply.to_bytes())

    async def _admit(self, req: TokenizeRequest, trace: str | None) -> Admitted | ErrorReply | None:
        check_ids(req.rid, req.gateway_id)
        if req.deadline <= time.time():
            raise DeadlineExceededError("the request's deadline passed before it was tokenized")
        if req.model != self.model:
            raise ModelNotFoundError(f"The model `{req.model}` does not exist.", param="model")
        tool_format = tool_format_for(req, self.tool_format)
        sampling = tool_sampling(req, tool_format)
        start = time.perf_counter()
        if req.kind is PromptKind.TOKENS:  # ids as given: a range check, not worth a hop to the thread
            ids = prompt_ids(req, self.tokenizer)
        else:
            loop = asyncio.get_running_loop()
            ids = await loop.run_in_executor(self._tokenize_thread, prompt_ids, req, self.tokenizer)
        self.metrics.on_tokenized(time.perf_counter() - start, len(ids))
        candidates = self.registry.candidates(self.model)
        if not candidates:
            raise ServiceUnavailableError(f"no scheduler is available for model `{self.model}`; retry later")
        check_context(req, len(ids), min(c.heartbeat.context_len for c in candidates))
        # Sampling goes on as it came (plus the tool_choice grammar): the gateway checked it and the engine
        # checks it again when it admits it.
        gen = GenerateRequest(
            rid=req.rid,
            gateway_id=req.gateway_id,
            input_ids=ids,
            sampling=sampling,
            deadline=req.deadline,
            output_ids=req.output_ids,
        )
        reply = await self._forward(gen, req.session_id, trace)
        if isinstance(reply, Admitted) and tool_format is not None:
            reply = replace(reply, tool_format=tool_format.name)  # tells the gateway to parse tool calls
        return reply

    async def _forward(
        self, gen: GenerateRequest, session_id: str | None, trace: str | None
    ) -> Admitted | ErrorReply | None:
        """Sends to the routed instance; a silent, gone or full instance makes it try the next one."""
        end = min(gen.deadline, time.time() + self.admit_timeout_s)
        tried: set[str] = set()
        slow: set[str] = (
            set()
        )  # live but did not answer in time: busy, not gone (the same rid may be retried)
        refusal: ErrorReply | None = None
        while (left := end - time.time()) > 0:
            candidates = [c for c in self.registry.candidates(self.model) if c.instance_id not in tried]
            if not candidates and slow:
                tried -= slow  # only slow ones left: ask them again (admission is idempotent per rid)
                slow.clear()
                continue
            if not candidates:
                break
            instance, prefill = self.router.pick_pair(gen.input_ids, session_id, candidates)
            gen = replace(gen, prefill_instance=prefill)
            tried.add(instance)
            self.registry.note_routed(instance)
            try:
                with self.metrics.nats.request("generate"):
                    msg = await self.nc.request(
                        generate_subject(instance),
                        gen.to_bytes(),
                        timeout=min(self.attempt_timeout_s, left),
                        headers=headers(gen.rid, gen.deadline, trace),
                    )
                reply = decode(msg.data, Admitted, ErrorReply)
            except nats.errors.NoRespondersError:
                log.warning("scheduler %s has no responder; dropping it until its next heartbeat", instance)
                self.registry.forget(instance)
                if self.kv_feed is not None:
                    self.kv_feed.forget(instance)
                continue
            except nats.errors.TimeoutError:
                log.warning("scheduler %s did not answer admission of %s in time", instance, gen.rid)
                slow.add(instance)
                continue
            if isinstance(reply, ErrorReply) and reply.error.status == 503:
                refusal = reply  # full or draining: another instance may have room
                continue
            return reply
        if refusal is not None:
            return refusal
        if gen.deadline <= time.time():
            raise DeadlineExceededError("the request's deadline passed while waiting for a scheduler")
        if slow:
            # Busy, not gone or full: no answer lets the gateway retry the same rid after its attempt timeout,
            # where a 503 would fail a request a live scheduler is about to admit (its deadline still bounds it).
            return None
        raise ServiceUnavailableError(
            f"no scheduler for model `{self.model}` admitted the request; retry later"
        )
