"""One choice of one client request, from admission to its last token: admits through the bus, then turns the
ordered TextDeltas into ChoiceEvents (stop strings applied), and ends it with a clear error rather than hang
when the deadline passes, output stops, the admitting scheduler vanishes or the stream loses a delta."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from kubesgl.errors import DeadlineExceededError, KubesglError, ServiceUnavailableError
from kubesgl.openai_api.stop_strings import StopStringFilter
from kubesgl.protocol import Admitted, FinishReason, TextDelta, TokenizeRequest, TokenLogprob
from kubesgl.services.gateway.bus import GatewayBus
from kubesgl.services.gateway.migration import resume_request
from kubesgl.services.gateway.request_stream import RequestStream

# A missing delta with later ones already here: NATS dropped it (e.g. across a restart); it will not come.
_GAP_TIMEOUT_S = 10.0


@dataclass
class ChoiceEvent:
    """Newly releasable output of one choice; `finish_reason` is set on its last event."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: FinishReason | None = None
    matched_stop: str | int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # asked for without echo (native logprob_start_len)


@dataclass(frozen=True)
class Limits:
    deadline: float  # absolute, unix seconds (what the wire carries to the other processes)
    inactivity_s: float
    # The same deadline on this process's monotonic clock, taken when the limits are made: a stream's expiry must
    # not move when the wall clock is stepped or slewed (on CI a 2 s deadline once fired 6 ms early by the
    # client's monotonic clock, with the stream timed on time.time()).
    deadline_mono: float = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "deadline_mono", time.monotonic() + (self.deadline - time.time()))


@dataclass
class ChoiceGeneration:
    bus: GatewayBus
    index: int
    request: TokenizeRequest
    stops: tuple[str, ...]
    limits: Limits
    traceparent: str | None = None
    logprobs: bool = False  # the answer shows logprobs
    echo: bool = False  # the first event starts with the prompt (and its logprobs)
    admitted: Admitted | None = None
    _stream: RequestStream | None = field(default=None, repr=False)
    _finished: bool = field(default=False, repr=False)
    _tokens: list[int] = field(default_factory=list, repr=False)  # streamed so far: what a migration resumes
    _prompt_logprobs_sent: bool = field(default=False, repr=False)
    _migrations: int = field(default=0, repr=False)
    _migration_s: float = field(default=0.0, repr=False)  # the pause its migrations added, summed
    _epoch: str = field(
        default="", repr=False
    )  # the admitting instance's process epoch (its restart is its death)
    _stop_filter: StopStringFilter[TokenLogprob] = field(init=False, repr=False)
    _last_output: float = field(default=0.0, repr=False)  # monotonic time of the last delta taken
    _on_event: Callable[[ChoiceEvent], None] | None = field(default=None, repr=False)  # push_events'
    _push_error: Exception | None = field(default=None, repr=False)  # what _on_event raised

    def __post_init__(self) -> None:
        self._stop_filter = StopStringFilter(self.stops)

    async def admit(self) -> Admitted:
        self._stream = self.bus.open(self.request.rid)
        if self._on_event is not None:  # a migration's new stream
            self._stream.set_sink(self._take_pushed)
        self.admitted = await self.bus.admit(self._stream, self.request, self.traceparent)
        self._epoch = self.bus.registry.epoch(self.admitted.instance_id)
        return self.admitted

    def close(self) -> None:
        """Idempotent; aborts at the schedulers unless the choice finished there."""
        if self._stream is not None:
            self.bus.close(self._stream, abort=not self._finished)
            self._finished = True

    def push_events(self, on_event: Callable[[ChoiceEvent], None]) -> None:
        """Hands the choice's events to `on_event` as their deltas arrive, in the bus's delivery, instead of
        through events() (which then wakes only for what ends the choice: its last delta, an error, the deadline,
        a lost instance). `on_event` must not raise: it runs inside the delivery of every stream's deltas. Only
        for a choice without stop strings, whose events never end it early (with stop strings, nothing changes).
        A delta that arrives while events() still holds undelivered ones goes through events() too, so the
        order holds. Call it from events()'s consumer, before or between its events."""
        if self.stops or self._stream is None:
            return
        self._on_event = on_event
        self._stream.set_sink(self._take_pushed)

    def _take_pushed(self, delta: TextDelta) -> bool:
        """The stream's sink: takes a delta that neither ends the choice nor comes past the deadline."""
        if delta.finished or delta.error is not None or self._on_event is None:
            return False
        now = time.monotonic()
        if now >= self.limits.deadline_mono:
            return False  # events() raises the deadline
        event, _ = self._event(delta, self._stop_filter, self._tokens)
        self._last_output = now
        self._on_event(event)
        return True

    def fail_pushed(self, error: Exception) -> None:
        """Ends the choice with `error`, in events(): what push_events handed on could not be sent."""
        self._push_error, self._on_event = error, None
        if self._stream is not None:
            self._stream.set_sink(None)
            self._stream.wake()

    async def events(self) -> AsyncIterator[ChoiceEvent]:
        """One event per delta while the client keeps up; a stream that fell behind (its deltas queued while it
        was writing) gets every delta already here in one event: one SSE chunk, never an empty wait for more."""
        assert self._stream is not None, "admit() first"
        stop_filter, tokens = self._stop_filter, self._tokens
        self._last_output = time.monotonic()
        while True:
            if self._push_error is not None:
                raise self._push_error
            # Checked before every wait, not only after a silent one: a stream whose deltas never pause
            # would otherwise outlive its deadline (the scheduler's own expiry comes seconds later).
            left = self.limits.deadline_mono - time.monotonic()
            if left <= 0:
                raise DeadlineExceededError("the request exceeded its deadline")
            # None at the stream's next tick (every TICK_S) when nothing came: the checks below run then.
            delta = await self._stream.next(left)
            if delta is None:
                if self._instance_gone():
                    await self._migrate(self._last_output)
                    self._last_output = time.monotonic()
                    continue
                self._raise_if_stuck(self._last_output)
                continue
            self._last_output = time.monotonic()
            event, done = self._event(delta, stop_filter, tokens)
            while not done and (queued := self._stream.next_ready()) is not None:
                try:
                    later, done = self._event(queued, stop_filter, tokens)
                except KubesglError:
                    yield event  # what came before the failure goes out first, as one delta at a time did
                    raise
                event = joined([event, later])
            yield event
            if done:
                return

    def _event(
        self, delta: TextDelta, stop_filter: StopStringFilter[TokenLogprob], tokens: list[int]
    ) -> tuple[ChoiceEvent, bool]:
        """The event one delta makes, and whether it ends the choice."""
        want_logprobs = self.logprobs
        _raise_if_failed(delta)
        released = stop_filter.push(delta.text, delta.logprobs)
        tokens.extend(delta.token_ids)
        event = ChoiceEvent(
            self.index,
            released.text,
            list(delta.token_ids),
            released.items if want_logprobs else None,
            delta.prompt_tokens or (self.admitted.prompt_tokens if self.admitted else 0),
            delta.cached_tokens,
            delta.completion_tokens,
        )
        self._prompt_logprobs_sent |= delta.prompt_logprobs is not None
        if self.echo and delta.prompt_logprobs is not None:  # the first delta carries the prompt
            self._echo(event, delta)
        elif want_logprobs:
            event.prompt_logprobs = delta.prompt_logprobs
        if stop_filter.stopped:
            # The scheduler is still generating: close() aborts it.
            event.finish_reason, event.matched_stop = FinishReason.STOP, stop_filter.matched
            return event, True
        if delta.finished:
            tail = stop_filter.flush()
            event.text += tail.text
            if want_logprobs:
                event.logprobs = [*(event.logprobs or ()), *tail.items]
            event.finish_reason = delta.finish_reason
            if delta.finish_reason is FinishReason.STOP and tokens:
                event.matched_stop = tokens[-1]
            self._finished = True
            return event, True
        return event, False

    def _echo(self, event: ChoiceEvent, delta: TextDelta) -> None:
        """Puts the prompt in front of the event's text and logprobs: a text prompt as the client sent it,
        token ids as the detokenizer decoded them."""
        prompt = self.request.prompt if self.request.prompt is not None else delta.prompt_text or ""
        event.text = prompt + event.text
        if event.logprobs is not None:
            event.logprobs = [*(delta.prompt_logprobs or ()), *event.logprobs]

    def _raise_if_stuck(self, last_output: float) -> None:
        assert self._stream is not None
        if time.monotonic() - last_output > self.limits.inactivity_s:
            raise DeadlineExceededError(f"no output from the scheduler for {self.limits.inactivity_s:g} s")
        if self._stream.gap_age() > _GAP_TIMEOUT_S:
            raise ServiceUnavailableError("part of the output stream was lost in transit")

    def _instance_gone(self) -> bool:
        assert self._stream is not None
        instance = self._stream.instance_id
        return instance is not None and self.bus.scheduler_gone(instance, self._epoch)

    async def _migrate(self, paused_since: float) -> None:
        """The admitting instance died: the choice is admitted again elsewhere as its prompt plus the tokens
        streamed so far (migration.py), or, past its budget (moves, or pause added since `paused_since`, its
        last delta) or if no instance takes it, fails clearly."""
        assert self._stream is not None and self._stream.instance_id is not None
        instance, policy = self._stream.instance_id, self.bus.migration
        lost = f"scheduler instance {instance} stopped responding; the request was lost"
        left_s = policy.max_seconds - self._migration_s - (time.monotonic() - paused_since)
        if self._migrations >= policy.max_migrations or left_s <= 0:
            if policy.max_migrations:
                policy.started(self.request.rid, instance, len(self._tokens), None).failed("budget")
                if self._migrations >= policy.max_migrations:
                    lost += f" (it had moved {self._migrations} times already)"
                else:
                    lost += f" (moving it would pause its stream past {policy.max_seconds:g} s)"
            raise ServiceUnavailableError(lost)
        self._migrations += 1
        migration = policy.started(self.request.rid, instance, len(self._tokens), self.traceparent)
        self.bus.close(self._stream, abort=False)
        self.bus.abort(self._stream.rid, instance)  # were it only cut off, it stops and frees its pages
        self.request = resume_request(
            self.request, self._migrations, self._tokens, self._prompt_logprobs_sent
        )
        try:
            admitted = await asyncio.wait_for(self.admit(), left_s)
        except TimeoutError:
            migration.failed("budget")
            raise ServiceUnavailableError(
                f"{lost}; no other instance took it within the {policy.max_seconds:g} s migration budget"
            ) from None
        except KubesglError as e:
            migration.failed(str(e))
            raise ServiceUnavailableError(f"{lost}; moving it to another instance failed: {e}") from e
        finally:
            self._migration_s += time.monotonic() - paused_since
        migration.admitted(admitted.instance_id)


def joined(events: list[ChoiceEvent]) -> ChoiceEvent:
    """Successive events of one choice as one: texts, tokens and logprobs in order, the last one's counts."""
    if len(events) == 1:
        return events[0]
    first, last = events[0], events[-1]
    logprobs = None
    if any(e.logprobs is not None for e in events):
        logprobs = [lp for e in events for lp in e.logprobs or ()]
    return ChoiceEvent(
        first.index,
        "".join(e.text for e in events),
        [t for e in events for t in e.token_ids],
        logprobs,
        last.prompt_tokens,
        last.cached_tokens,
        last.completion_tokens,
        last.finish_reason,
        last.matched_stop,
        next((e.prompt_logprobs for e in events if e.prompt_logprobs is not None), None),
    )


def _raise_if_failed(delta: TextDelta) -> None:
    if delta.error is not None:
        raise delta.error.to_error()
    if delta.finished and delta.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        raise KubesglError(f"the scheduler ended the request ({delta.finish_reason})")
