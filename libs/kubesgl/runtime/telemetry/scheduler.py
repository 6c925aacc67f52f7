"""What a scheduler instance reports about each request it runs: SGLang's request metrics and the
queue -> prefill -> decode spans, both timed from the GenerateRequest's arrival and the engine's outputs; with
prefill/decode disaggregation, the prefill instance's prefill span and the decode instance's kv transfer span.

The engine does not say when a request leaves the waiting queue, so prefill is timed as the engine step
that produced the first token (with chunked prefill: the last chunk) and queue as everything before it.
The service calls, in its loop: on_arrival() when it admits a GenerateRequest, on_step_start() before
engine.step(), on_outputs() with what the step returned (it answers the `traceparent` for each request's
TokenDelta), on_abort() when it drops a request itself, and on_step() with engine stats about once a second
(which also feeds the periodic stats log line, stats_log.py). Disaggregation (services/scheduler/pd.py): the
decode instance calls on_remote_prefill() when it asks a prefill instance for the prompt (its queue span ends
there, and no prefill span is made here), on_transfer() when a KV pull's outcome is known and on_no_prefill()
when no handoff came in time; the prefill instance calls on_prefill_ask() and on_prefill_done(). Those spans are
made only under a sampled parent: a request's trace is never started by them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from opentelemetry.context import Context
from opentelemetry.trace import Span, Status, StatusCode

from kubesgl.protocol import HEADER_TRACEPARENT, header_traceparent
from kubesgl.runtime.telemetry.metrics import SchedulerMetrics
from kubesgl.runtime.telemetry.stats_log import StatsLog
from kubesgl.runtime.telemetry.tracing import (
    ATTR_CACHED_TOKENS,
    ATTR_DECODE_INSTANCE,
    ATTR_FINISH_REASON,
    ATTR_INSTANCE,
    ATTR_KV_BYTES,
    ATTR_KV_OUTCOME,
    ATTR_KV_PAGES,
    ATTR_MODEL,
    ATTR_OUTPUT_TOKENS,
    ATTR_PREFILL_INSTANCE,
    ATTR_PROMPT_TOKENS,
    ATTR_RID,
    SPAN_DECODE,
    SPAN_KV_TRANSFER,
    SPAN_PREFILL,
    SPAN_QUEUE,
    Attributes,
    Tracing,
    extract,
    traceparent,
)
from kubesgl.values.outputs import EngineStats, RequestOutput


@dataclass
class _Timeline:
    """One running request: when it arrived, its trace parent, the span open now, its last token time."""

    arrival_s: float
    arrival_ns: int
    parent: Context
    parent_traceparent: str | None  # the header `parent` came from
    current: Span  # queue until the first token, then decode
    current_traceparent: str | None  # `current`'s, made once per span rather than once per token
    decoding: bool = False
    last_token_s: float = 0.0
    asked_ns: int | None = None  # when a prefill instance was asked for the prompt (disaggregation)


class SchedulerTelemetry:
    """Per-request timing for one scheduler instance; safe to call from the engine thread and the event loop."""

    def __init__(
        self,
        metrics: SchedulerMetrics,
        tracing: Tracing,
        instance_id: str,
        model: str,
        clock: Callable[[], float] = time.perf_counter,
        stats_log: StatsLog | None = None,
    ) -> None:
        self.metrics = metrics
        self._stats_log = stats_log
        self._tracing = tracing
        self._attrs = {ATTR_INSTANCE: instance_id, ATTR_MODEL: model}
        self._clock = clock
        self._lock = threading.Lock()
        self._requests: dict[str, _Timeline] = {}
        self._prefills: dict[str, Span] = {}  # prefill instance: prompts computed for a decode instance
        self._step_start_ns = 0

    def on_arrival(self, rid: str, headers: Mapping[str, str] | None, prompt_tokens: int) -> None:
        """A GenerateRequest was admitted; a repeated rid (an idempotent retry) changes nothing."""
        now_s, now_ns = self._clock(), time.time_ns()
        with self._lock:
            if rid in self._requests:
                return
            parent = extract(headers)
            attrs = {**self._attrs, ATTR_RID: rid, ATTR_PROMPT_TOKENS: prompt_tokens}
            queue = self._tracing.start_span(SPAN_QUEUE, parent, attrs, start_time_ns=now_ns)
            parent_traceparent = header_traceparent(headers)
            self._requests[rid] = _Timeline(
                now_s, now_ns, parent, parent_traceparent, queue, traceparent(queue)
            )

    def on_step_start(self) -> None:
        """The engine is about to run a step (its start is when this step's prefills began)."""
        self._step_start_ns = time.time_ns()

    def on_outputs(
        self, outputs: Iterable[RequestOutput], step_start_ns: int | None = None
    ) -> dict[str, str | None]:
        """Records one step's outputs; returns each request's `traceparent` for the TokenDelta it causes.
        `step_start_ns` is when the step began, where the engine runs in another process (engine_process.py)
        and on_step_start is not called here."""
        now_s, now_ns = self._clock(), time.time_ns()
        parents: dict[str, str | None] = {}
        generated = 0
        intervals: list[float] = []  # one per token of a decoding request, the step's for SchedulerMetrics
        requests = self._requests
        with self._lock:
            if step_start_ns is not None:
                self._step_start_ns = step_start_ns
            for out in outputs:
                rid = out.rid
                t = requests.get(rid)
                if t is None:
                    continue
                if n := len(out.new_token_ids):
                    generated += n
                    if not t.decoding:
                        self._first_tokens(out, t, now_s, now_ns)
                    elif n == 1:
                        intervals.append(now_s - t.last_token_s)
                    else:  # like SGLang: the interval spread evenly over the tokens it delivered
                        intervals += [(now_s - t.last_token_s) / n] * n
                    t.last_token_s = now_s
                parents[rid] = t.current_traceparent
                if out.finished:
                    del requests[rid]
                    self._finish(t, out.finish_reason, out.completion_tokens, now_s, now_ns)
        self.metrics.on_step_tokens(generated, intervals)
        return parents

    def on_abort(self, rid: str) -> None:
        """The service dropped a request (client abort, deadline, drain) without a final engine output."""
        now_s, now_ns = self._clock(), time.time_ns()
        with self._lock:
            t = self._requests.pop(rid, None)
            if t is not None:
                self._finish(t, "abort", None, now_s, now_ns)

    # -- disaggregation: the decode instance ----------------------------------------------------------
    def on_remote_prefill(self, rid: str) -> str | None:
        """A prefill instance is asked for the request's prompt now: the request's queue here ends, and its first
        token will come from there (that instance makes its prefill span). Returns the `traceparent` for the
        PrefillAsk: the request's parent here, so the prefill span sits beside this instance's spans."""
        now_ns = time.time_ns()
        with self._lock:
            t = self._requests.get(rid)
            if t is None:
                return None
            t.asked_ns = now_ns
            return t.parent_traceparent

    def on_transfer(
        self,
        rid: str,
        prefill_instance: str,
        outcome: str,
        pages: int,
        nbytes: int,
        start_ns: int,
        end_ns: int,
    ) -> None:
        """The request's KV pull from `prefill_instance` ended: `outcome` ok, or why the request went on without
        it (then it is prefilled here)."""
        attrs = {ATTR_KV_PAGES: pages, ATTR_KV_BYTES: nbytes}
        with self._lock:
            self._transfer_span(rid, prefill_instance, outcome, attrs, start_ns, end_ns)

    def on_no_prefill(self, rid: str, prefill_instance: str) -> None:
        """No handoff came from `prefill_instance` in time: the request is prefilled here, so its prefill span
        will be this instance's after all."""
        now_ns = time.time_ns()
        with self._lock:
            t = self._requests.get(rid)
            if t is None or t.asked_ns is None:
                return
            start_ns, t.asked_ns = t.asked_ns, None
            self._transfer_span(rid, prefill_instance, "no_prefill", {}, start_ns, now_ns)

    def _transfer_span(
        self, rid: str, prefill_instance: str, outcome: str, attrs: Attributes, start_ns: int, end_ns: int
    ) -> None:
        t = self._requests.get(rid)
        if t is None or not self._tracing.records_under(t.parent_traceparent):
            return
        attrs = {**self._attrs, **attrs, ATTR_RID: rid, ATTR_PREFILL_INSTANCE: prefill_instance}
        span = self._tracing.start_span(
            SPAN_KV_TRANSFER, t.parent, {**attrs, ATTR_KV_OUTCOME: outcome}, start_time_ns=start_ns
        )
        if outcome != "ok":
            span.set_status(Status(StatusCode.ERROR, f"no KV pulled: {outcome}"))
        span.end(end_time=end_ns)

    # -- disaggregation: the prefill instance ---------------------------------------------------------
    def on_prefill_ask(
        self,
        rid: str,
        parent_traceparent: str | None,
        decode_instance: str,
        prompt_tokens: int,
        received_ns: int,
    ) -> None:
        """A decode instance asked (at `received_ns`) for the request's prompt; the span is made only under a
        sampled parent, the request's on the decode instance."""
        if not self._tracing.records_under(parent_traceparent):
            return
        parent = {HEADER_TRACEPARENT: parent_traceparent or ""}
        attrs = {
            **self._attrs,
            ATTR_RID: rid,
            ATTR_DECODE_INSTANCE: decode_instance,
            ATTR_PROMPT_TOKENS: prompt_tokens,
        }
        span = self._tracing.start_span(SPAN_PREFILL, parent, attrs, start_time_ns=received_ns)
        with self._lock:
            self._prefills[rid] = span

    def on_prefill_done(self, rid: str, cached_tokens: int, pages: int, error: str | None = None) -> None:
        """The PrefillDone was sent (`pages` of KV handed off), or the prompt was refused with `error`."""
        now_ns = time.time_ns()
        with self._lock:
            span = self._prefills.pop(rid, None)
        if span is None:
            return
        span.set_attributes({ATTR_CACHED_TOKENS: cached_tokens, ATTR_KV_PAGES: pages})
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=now_ns)

    def on_step(self, stats: EngineStats) -> None:
        self.metrics.on_step(stats)
        if self._stats_log is not None:
            self._stats_log.observe(stats)

    def _first_tokens(self, out: RequestOutput, t: _Timeline, now_s: float, now_ns: int) -> None:
        """The request's first tokens: its time to first token, and its span turns from queue (with prefill)
        to decode."""
        self.metrics.on_first_token(now_s - t.arrival_s, out.prompt_tokens, out.cached_tokens)
        if t.asked_ns is not None:  # prefilled by another instance, whose span it is
            t.current.end(end_time=t.asked_ns)
        else:
            prefill_start_ns = max(t.arrival_ns, self._step_start_ns)
            t.current.end(end_time=prefill_start_ns)
            attrs = {
                **self._attrs,
                ATTR_PROMPT_TOKENS: out.prompt_tokens,
                ATTR_CACHED_TOKENS: out.cached_tokens,
            }
            prefill = self._tracing.start_span(SPAN_PREFILL, t.parent, attrs, start_time_ns=prefill_start_ns)
            prefill.end(end_time=now_ns)
        t.current = self._tracing.start_span(SPAN_DECODE, t.parent, self._attrs, start_time_ns=now_ns)
        t.current_traceparent = traceparent(t.current)
        t.decoding = True

    def _finish(
        self,
        t: _Timeline,
        finish_reason: str | None,
        completion_tokens: int | None,
        now_s: float,
        now_ns: int,
    ) -> None:
        self.metrics.on_finished(now_s - t.arrival_s, finish_reason)
        span = t.current
        if finish_reason:
            span.set_attribute(ATTR_FINISH_REASON, [str(finish_reason)])  # the enum's value
        if completion_tokens is not None:
            span.set_attribute(ATTR_OUTPUT_TOKENS, completion_tokens)
        if finish_reason == "abort":
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end(end_time=now_ns)
