"""The scheduler service's side of prefill/decode disaggregation: the bus in and out of the roles of
engine/scheduler/disagg.py, which run on the engine thread (RunOnEngine commands and the loop's StepHook).

Decode instance (owns the request): admission checks it as usual, then asks the named prefill instance
(PrefillAsk); the PrefillDone that comes back is its first output, reported at once, and the pull of its KV;
the pull's end sends KvRelease. No PrefillDone within the handoff timeout (a stuck prefill instance), its prefill
instance silent for the heartbeat expiry or heartbeating as another process (dead, restarted), a failed pull, or
a refused one: the request is prefilled here. Prefill instance: PrefillAsk -> a hand-off request;
its handoff (or its end at the first token) -> PrefillDone to the decode instance; its pages stay locked until
KvRelease, or the handoff timeout. A decode instance that stops waiting (an abort, a fallback) sends KvRelease at
once: a prompt still being computed is aborted, a handoff already sent is unlocked.

Traces: the PrefillAsk carries the request's `traceparent` in its headers, as every admission does; the prefill
instance's `prefill` span (PrefillAsk in, PrefillDone sent) and the decode instance's `kv transfer` span join the
request's trace there (SchedulerTelemetry's disaggregation calls).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
from kubesgl.engine.engine import Engine
from kubesgl.engine.scheduler.disagg import (
    DecodeRole,
    DisaggregationMode,
    KvHandoff,
    PrefillRole,
    TransferEnd,
    TransferOutcome,
)
from kubesgl.errors import KubesglError
from kubesgl.kv.kv_transfer import KvTransferAgent
from kubesgl.protocol import (
    HEARTBEAT,
    GenerateRequest,
    Heartbeat,
    KvRelease,
    PrefillAsk,
    PrefillDone,
    ProtocolError,
    decode,
    handoff_subject,
    header_traceparent,
    headers,
    prefill_subject,
)
from kubesgl.routing import SchedulerRegistry
from kubesgl.runtime.heard_clock import HeardClock
from kubesgl.runtime.lifecycle import TaskGroup
from kubesgl.runtime.telemetry.metrics import DisaggregationMetrics
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.services.scheduler.engine_loop import Command, RunOnEngine
from kubesgl.values.outputs import RequestOutput
from kubesgl.values.sampling import SamplingParams
from nats.aio.client import Client
from nats.aio.msg import Msg

log = logging.getLogger("kubesgl.scheduler.pd")


@dataclass
class _Ask:
    input_ids: list[int]
    params: SamplingParams
    prefill_instance: str
    at: float
    # The prefill instance's process epoch when asked ("" unknown): another process knows nothing of the ask.
    epoch: str


class PdHook:
    def __init__(
        self,
        nc: Client,
        instance_id: str,
        mode: DisaggregationMode,
        handoff_timeout_s: float,
        metrics: DisaggregationMetrics,
    ) -> None:
        self.nc, self.instance_id, self.mode = nc, instance_id, mode
        self._loop, self._tasks = asyncio.get_running_loop(), TaskGroup()
        self.handoff_timeout_s = handoff_timeout_s
        self.metrics = metrics
        self.submit: Callable[[Command], None] = lambda c: None  # the engine loop's, set by the service
        # Engine thread only, from here on.
        self._telemetry: SchedulerTelemetry | None = None  # the engine loop's, once the model is loaded
        self._prefill: PrefillRole | None = None
        self._decode: DecodeRole | None = None
        self._asked: dict[str, _Ask] = {}  # decode: requests waiting for their PrefillDone
        self._prefill_of: dict[str, str] = {}  # decode: rid -> the prefill instance holding its pages
        self._decode_of: dict[str, str] = {}  # prefill: rid -> the decode instance that asked
        # Decode: the instances' heartbeats, recorded by the event loop; the engine thread asks whether a
        # prefill instance is gone, judged as the gateways judge schedulers (on what this process has read).
        self._peers = SchedulerRegistry()
        self._heard_clock = HeardClock(nc)
        self._peers.judge_at(self._heard_clock)
        self._listening_since = time.monotonic()

    async def start(self) -> None:
        subject = prefill_subject if self.mode is DisaggregationMode.PREFILL else handoff_subject
        await self.nc.subscribe(subject(self.instance_id), cb=self._on_message)
        if self.mode is DisaggregationMode.DECODE:
            self._listening_since = time.monotonic()
            await self.nc.subscribe(HEARTBEAT, cb=self._on_heartbeat)
            self._heard_clock.start()

    async def _on_heartbeat(self, msg: Msg) -> None:
        try:
            hb = Heartbeat.from_bytes(msg.data)
        except ProtocolError as e:
            log.warning("dropping a malformed Heartbeat: %s", e)
            return
        self._peers.observe(hb)

    # -- event loop -------------------------------------------------------------------------------------
    def admit(self, req: GenerateRequest, done: Callable[[KubesglError | None], None]) -> Command:
        """The decode side's admission of a request the router gave a prefill instance."""

        def run(engine: Engine) -> list[RequestOutput]:
            try:
                engine.scheduler.admission.check(req.rid, req.input_ids, req.sampling)
            except KubesglError as e:
                done(e)
                return []
            epoch = self._peers.epoch(req.prefill_instance)
            self._asked[req.rid] = _Ask(
                req.input_ids, req.sampling, req.prefill_instance, time.monotonic(), epoch
            )
            trace = self.telemetry.on_remote_prefill(req.rid)
            ask = PrefillAsk(req.rid, self.instance_id, req.input_ids, req.sampling, req.deadline)
            self._publish(prefill_subject(req.prefill_instance), ask, headers(req.rid, req.deadline, trace))
            done(None)
            return []

        return RunOnEngine(run)

    async def _on_message(self, msg: Msg) -> None:
        try:
            m = decode(msg.data, PrefillAsk, PrefillDone, KvRelease)
        except ProtocolError as e:
            log.warning("ignoring malformed disaggregation message: %s", e)
            return
        if isinstance(m, PrefillAsk):
            trace, at_ns = header_traceparent(msg.headers), time.time_ns()
            self.submit(RunOnEngine(lambda engine: self._add_prefill(engine, m, trace, at_ns)))
        elif isinstance(m, KvRelease):
            self.submit(RunOnEngine(lambda engine: self._release(engine, m.rid)))
        else:
            self.submit(RunOnEngine(lambda engine: self._received(engine, m)))

    def _publish(
        self,
        subject: str,
        message: PrefillAsk | PrefillDone | KvRelease,
        hdrs: dict[str, str] | None = None,
        sent: Callable[[], None] | None = None,
    ) -> None:
        """From the engine thread: hands the publish to the event loop (which calls `sent` once it is out).
        `hdrs`: the message's headers, by default its rid's."""
        send = self._send(subject, message.to_bytes(), hdrs or headers(message.rid), sent)
        self._loop.call_soon_threadsafe(self._tasks.spawn, send)

    async def _send(
        self, subject: str, data: bytes, hdrs: dict[str, str], sent: Callable[[], None] | None
    ) -> None:
        try:
            await self.nc.publish(subject, data, headers=hdrs)
        except nats.errors.Error as e:  # the peer's timeouts cover a lost message
            log.warning("disaggregation message to %s not sent: %s", subject, e)
        if sent is not None:
            sent()

    # -- engine thread ----------------------------------------------------------------------------------
    @property
    def telemetry(self) -> SchedulerTelemetry:
        assert self._telemetry is not None, "set when the model is loaded, before any request comes"
        return self._telemetry

    def loaded(self, engine: Engine, telemetry: SchedulerTelemetry) -> None:
        """The NIXL agent starts and registers the KV cache here, before the first heartbeat: it holds the GIL
        for a while (0.5 s on an idle 2-core box), which must not delay the heartbeats of a live instance."""
        self._telemetry = telemetry
        self._roles(engine)

    def _roles(self, engine: Engine) -> None:
        if self._prefill is None and self._decode is None:
            agent = KvTransferAgent(self.instance_id, engine.runner.kv)
            if self.mode is DisaggregationMode.PREFILL:
                self._prefill = PrefillRole(engine.scheduler, agent)
            else:
                self._decode = DecodeRole(engine.scheduler, agent, self.handoff_timeout_s)

    @property
    def busy(self) -> bool:
        """KV pulls in flight: the loop polls them between steps (waiting asks need only its idle wake-ups)."""
        return self._decode is not None and self._decode.busy

    def after_step(self, engine: Engine, outputs: list[RequestOutput]) -> list[RequestOutput]:
        self._roles(engine)
        if self._prefill is not None:
            return self._after_prefill_step(outputs)
        assert self._decode is not None
        ended = self._decode.poll()
        for rid, prefill in self._prefill_of.items():
            if self._peers.gone(prefill, since=self._listening_since):
                self._decode.give_up(rid)  # a pull from a dead peer may hang: the request goes on now
        self._report(self._decode.take_ended())  # while _prefill_of still names their prefill instances
        for rid in ended:
            self._publish(prefill_subject(self._prefill_of.pop(rid)), KvRelease(rid))
        now = time.monotonic()
        for rid, why in [(r, w) for r, a in self._asked.items() if (w := self._no_prefill(a, now))]:
            ask = self._asked[rid]
            self._abandon(rid)
            log.warning("no prefill of %s from %s (%s): prefilling it here", rid, ask.prefill_instance, why)
            self._decode.prefill_here(rid, ask.input_ids, ask.params)
            self.metrics.fallbacks.labels(reason="no_prefill").inc()
            self.telemetry.on_no_prefill(rid, ask.prefill_instance)
        return outputs

    def _abandon(self, rid: str) -> None:
        """Stops waiting for the prompt's PrefillDone; the prefill instance is told to stop computing it, or to
        unlock its pages if its handoff is already on the way (KvRelease either way)."""
        ask = self._asked.pop(rid, None)
        if ask is not None:
            self._publish(prefill_subject(ask.prefill_instance), KvRelease(rid))

    def _no_prefill(self, ask: _Ask, now: float) -> str:
        """Why `ask` will get no PrefillDone ("" while it may): the handoff timeout passed, or its prefill
        instance stopped heartbeating (dead, or cut off from the bus) or restarted as another process."""
        if now - ask.at > self.handoff_timeout_s:
            return f"not within {self.handoff_timeout_s:g} s"
        if self._peers.gone(ask.prefill_instance, ask.epoch, since=self._listening_since):
            return "it stopped heartbeating or restarted"
        return ""

    def _report(self, ends: list[TransferEnd]) -> None:
        """Pulls whose outcome came: into the metrics, and each as its request's kv transfer span."""
        for e in ends:
            if e.outcome is TransferOutcome.OK:
                self.metrics.transfer_bytes.inc(e.nbytes)
                self.metrics.transfer_seconds.observe(e.seconds)
            elif e.outcome is not TransferOutcome.ABORTED:
                self.metrics.fallbacks.labels(reason="transfer").inc()
            end_ns = e.started_ns + int(e.seconds * 1e9)
            prefill = self._prefill_of.get(e.rid, "")
            self.telemetry.on_transfer(e.rid, prefill, e.outcome, e.pages, e.nbytes, e.started_ns, end_ns)

    def _after_prefill_step(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        assert self._prefill is not None
        keep = [o for o in outputs if o.rid not in self._decode_of]
        for out in [o for o in outputs if o.rid in self._decode_of]:  # ended at the first token
            done = PrefillDone(
                out.rid, 0, out.new_token_ids, out.cached_tokens, 0, b"", b"", out.logprobs,
                out.prompt_logprobs, True, out.finish_reason,
            )  # fmt: skip
            self._send_done(self._decode_of.pop(out.rid), done)
        for h in self._prefill.take_handoffs():
            self.metrics.handoffs.inc()
            o = h.output
            done = PrefillDone(
                h.rid, h.seed, o.new_token_ids, o.cached_tokens, h.num_pages, h.agent_metadata, h.descs,
                o.logprobs, o.prompt_logprobs,
            )  # fmt: skip
            self._send_done(self._decode_of.pop(h.rid), done)
        self._prefill.release_older_than(self.handoff_timeout_s)
        return keep

    def _send_done(self, decode_instance: str, done: PrefillDone) -> None:
        telemetry = self.telemetry

        def sent() -> None:
            telemetry.on_prefill_done(done.rid, done.cached_tokens, done.num_pages)

        self._publish(handoff_subject(decode_instance), done, sent=sent)

    def _add_prefill(
        self, engine: Engine, ask: PrefillAsk, trace: str | None, at_ns: int
    ) -> list[RequestOutput]:
        self._roles(engine)
        assert self._prefill is not None
        self.telemetry.on_prefill_ask(ask.rid, trace, ask.decode_instance, len(ask.input_ids), at_ns)
        try:
            self._prefill.add(ask.rid, ask.input_ids, ask.sampling)
        except KubesglError as e:  # the decode side checked it too: it prefills it itself after the timeout
            log.warning("prefill of %s refused: %s", ask.rid, e)
            self.telemetry.on_prefill_done(ask.rid, 0, 0, error=str(e))
            return []
        self._decode_of[ask.rid] = ask.decode_instance
        return []

    def _release(self, engine: Engine, rid: str) -> list[RequestOutput]:
        if self._prefill is not None:
            self._prefill.release(rid)
            if self._decode_of.pop(rid, None) is not None:  # released before its handoff: no PrefillDone
                self.telemetry.on_prefill_done(rid, 0, 0, error="released by the decode instance")
        return []

    def _received(self, engine: Engine, done: PrefillDone) -> list[RequestOutput]:
        self._roles(engine)
        assert self._decode is not None
        ask = self._asked.pop(done.rid, None)
        if ask is None:  # aborted, or prefilled here already: its KvRelease went out then (_abandon)
            return []
        n = len(ask.input_ids)
        out = RequestOutput(
            done.rid, done.new_token_ids, n, done.cached_tokens, len(done.new_token_ids), done.finished,
            done.finish_reason, done.logprobs, done.prompt_logprobs,
        )  # fmt: skip
        if done.finished:
            return [out]
        handoff = KvHandoff(
            done.rid, done.seed, out, done.logprobs or [], done.num_pages, done.agent_metadata, done.descs
        )
        self._prefill_of[done.rid] = ask.prefill_instance
        first = self._decode.receive(ask.input_ids, ask.params, handoff)
        self._report(self._decode.take_ended())  # a pull refused at once
        if not self._decode.pulling(done.rid):
            del self._prefill_of[done.rid]
            if done.num_pages:  # fell back at once: the prefill side's pages can go
                self._publish(prefill_subject(ask.prefill_instance), KvRelease(done.rid))
        return [first]

    def abort(self, engine: Engine, rid: str) -> None:
        self._abandon(rid)
        self._decode_of.pop(rid, None)
        if self._decode is not None:
            self._decode.abort(rid)
