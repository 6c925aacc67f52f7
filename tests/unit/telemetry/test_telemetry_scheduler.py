"""A scheduler's per-request telemetry: queue -> prefill -> decode spans under the tokenizer's span, and
SGLang's request metrics, both driven by engine outputs; a disaggregated request's prefill span on the prefill
instance and kv transfer span on the decode instance, in the same place of the same trace."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from kubesgl.runtime.telemetry.metrics import SchedulerMetrics
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.runtime.telemetry.tracing import (
    SPAN_DECODE,
    SPAN_KV_TRANSFER,
    SPAN_PREFILL,
    SPAN_QUEUE,
    SPAN_TOKENIZE,
    Tracing,
    traceparent,
)
from kubesgl.values.outputs import RequestOutput
from prometheus_client import CollectorRegistry
from support.otlp_receiver import OtlpReceiver, ReceivedSpan

MODEL = {"model_name": "tiny"}


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    for var in ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(var, raising=False)
    with OtlpReceiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.endpoint)
        yield r


def out(
    rid: str, tokens: list[int], done: int, finished: bool = False, reason: str | None = None
) -> RequestOutput:
    return RequestOutput(rid, tokens, prompt_tokens=12, cached_tokens=8, completion_tokens=done, finished=finished,
                         finish_reason=reason)  # fmt: skip


def telemetry(tracing: Tracing, instance_id: str = "sched-0") -> tuple[CollectorRegistry, SchedulerTelemetry]:
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, "tiny", page_size=1, num_pages=64)
    return registry, SchedulerTelemetry(metrics, tracing, instance_id=instance_id, model="tiny")


def tokenize_span(tracing: Tracing) -> dict[str, str]:
    """The tokenizer's span, ended, as the headers of the GenerateRequest it sent."""
    with tracing.span(SPAN_TOKENIZE) as span:
        return {"kubesgl-rid": "r1", "traceparent": traceparent(span) or ""}


def test_request_makes_queue_prefill_decode_spans_under_the_tokenizer(receiver: OtlpReceiver) -> None:
    tracing = Tracing("kubesgl-scheduler")
    _, tel = telemetry(tracing)
    headers = tokenize_span(tracing)
    tel.on_arrival("r1", headers, prompt_tokens=12)
    tel.on_step_start()
    first = tel.on_outputs([out("r1", [5], 1)])
    tel.on_step_start()
    tel.on_outputs([out("r1", [6, 7], 3)])
    last = tel.on_outputs([out("r1", [8], 4, finished=True, reason="stop")])
    tracing.shutdown()

    spans = receiver.wait_for(lambda s: len(s) == 4, timeout_s=10)
    by_name: dict[str, ReceivedSpan] = {s.name: s for s in spans}
    parent = by_name[SPAN_TOKENIZE]
    queue, prefill, decode = by_name[SPAN_QUEUE], by_name[SPAN_PREFILL], by_name[SPAN_DECODE]
    for span in (queue, prefill, decode):
        assert (span.trace_id, span.parent_span_id) == (parent.trace_id, parent.span_id)
        assert span.attributes["kubesgl.scheduler.instance"] == "sched-0"
    assert queue.end_ns == prefill.start_ns <= prefill.end_ns == decode.start_ns <= decode.end_ns
    assert prefill.attributes["kubesgl.cached_tokens"] == 8
    assert prefill.attributes["gen_ai.usage.input_tokens"] == 12
    assert decode.attributes["gen_ai.usage.output_tokens"] == 4
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["stop"]
    # Each TokenDelta names the decode span as parent, so the detokenizer's span joins this trace.
    assert first["r1"] == last["r1"] and first["r1"] and decode.span_id in first["r1"]


def test_outputs_feed_sglang_request_metrics() -> None:
    registry, tel = telemetry(Tracing("kubesgl-scheduler"))
    tel.on_arrival("r1", None, prompt_tokens=12)
    tel.on_outputs([out("r1", [5], 1)])
    tel.on_outputs([out("r1", [6, 7], 3)])
    tel.on_outputs([out("r1", [], 3, finished=True, reason="length")])
    assert registry.get_sample_value("sglang:time_to_first_token_seconds_count", MODEL) == 1
    assert registry.get_sample_value("sglang:inter_token_latency_seconds_count", MODEL) == 2
    assert registry.get_sample_value("sglang:e2e_request_latency_seconds_count", MODEL) == 1
    assert registry.get_sample_value("sglang:generation_tokens_total", MODEL) == 3
    assert registry.get_sample_value("sglang:prompt_tokens_total", MODEL) == 12
    assert registry.get_sample_value("sglang:cached_tokens_total", MODEL) == 8


def test_inter_token_latency_is_each_requests_interval_spread_over_its_tokens() -> None:
    """Three requests, timed by a fake clock: each step's intervals are per request, since its previous tokens;
    one that delivered two tokens counts its interval halved, twice (SGLang's ITL)."""
    now = [0.0]
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry, "tiny", page_size=1, num_pages=64)
    tel = SchedulerTelemetry(metrics, Tracing("kubesgl-scheduler"), "sched-0", "tiny", clock=lambda: now[0])
    for rid in ("a", "b", "c"):
        tel.on_arrival(rid, None, prompt_tokens=12)
    now[0] = 1.0
    tel.on_outputs([out("a", [1], 1), out("b", [1], 1)])  # first tokens: no interval
    now[0] = 1.5
    tel.on_outputs([out("a", [2], 2), out("b", [2, 3], 3), out("c", [1], 1)])  # 0.5; 0.25 twice; c's first
    now[0] = 2.5
    tel.on_outputs([out("a", [3], 3), out("c", [2], 2)])  # 1.0 each
    itl = "sglang:inter_token_latency_seconds"
    assert registry.get_sample_value(f"{itl}_count", MODEL) == 5
    assert registry.get_sample_value(f"{itl}_sum", MODEL) == pytest.approx(0.5 + 0.5 + 2.0, rel=1e-12)
    cumulative = {
        le: registry.get_sample_value(f"{itl}_bucket", {**MODEL, "le": le})
        for le in ("0.2", "0.4", "0.6", "1.0")
    }
    assert cumulative == {"0.2": 0, "0.4": 2, "0.6": 3, "1.0": 5}
    assert registry.get_sample_value("sglang:generation_tokens_total", MODEL) == 8


def test_abort_before_first_token_ends_the_queue_span_as_error(receiver: OtlpReceiver) -> None:
    tracing = Tracing("kubesgl-scheduler")
    registry, tel = telemetry(tracing)
    tel.on_arrival("r1", None, prompt_tokens=12)
    tel.on_abort("r1")
    tel.on_abort("r1")  # twice: already gone
    tel.on_outputs([out("r1", [], 0, finished=True, reason="abort")])  # a late engine output: ignored
    tracing.shutdown()
    [queue] = receiver.wait_for(lambda s: len(s) == 1, timeout_s=10)
    assert (queue.name, queue.status_code) == (SPAN_QUEUE, 2)
    assert registry.get_sample_value("sglang:num_aborted_requests_total", MODEL) == 1
    assert registry.get_sample_value("sglang:num_requests_total", MODEL) == 1
    assert registry.get_sample_value("sglang:time_to_first_token_seconds_count", MODEL) == 0


def test_repeated_arrival_of_a_known_rid_changes_nothing() -> None:
    registry, tel = telemetry(Tracing("kubesgl-scheduler"))
    tel.on_arrival("r1", None, prompt_tokens=12)
    tel.on_outputs([out("r1", [5], 1)])
    tel.on_arrival("r1", None, prompt_tokens=12)  # the tokenizer retried the GenerateRequest
    tel.on_outputs([out("r1", [6], 2, finished=True, reason="stop")])
    assert registry.get_sample_value("sglang:time_to_first_token_seconds_count", MODEL) == 1
    assert registry.get_sample_value("sglang:inter_token_latency_seconds_count", MODEL) == 1


def test_outputs_of_unknown_requests_are_ignored() -> None:
    registry, tel = telemetry(Tracing("kubesgl-scheduler"))
    assert tel.on_outputs([out("ghost", [1], 1, finished=True, reason="stop")]) == {}
    assert registry.get_sample_value("sglang:num_requests_total", MODEL) == 0


def test_disaggregated_request_has_the_prefill_there_and_transfer_and_decode_here(
    receiver: OtlpReceiver,
) -> None:
    tracing = Tracing("kubesgl-scheduler")
    _, decode = telemetry(tracing, "decode-0")
    _, prefill = telemetry(tracing, "prefill-0")
    headers = tokenize_span(tracing)
    decode.on_arrival("r1", headers, prompt_tokens=12)
    ask = decode.on_remote_prefill("r1")
    assert ask == headers["traceparent"]  # the PrefillAsk's: the request's parent on the decode instance
    prefill.on_prefill_ask("r1", ask, "decode-0", prompt_tokens=12, received_ns=time.time_ns())
    prefill.on_prefill_done("r1", cached_tokens=8, pages=3)
    decode.on_step_start()  # a step of other requests: not this one's prefill
    pull_start = time.time_ns()
    decode.on_outputs([out("r1", [5], 1)])  # the PrefillDone's first token
    decode.on_transfer(
        "r1", "prefill-0", "ok", pages=3, nbytes=3072, start_ns=pull_start, end_ns=time.time_ns()
    )
    decode.on_outputs([out("r1", [6], 2, finished=True, reason="length")])
    tracing.shutdown()

    spans = receiver.wait_for(lambda s: len(s) == 5, timeout_s=10)
    assert sorted(s.name for s in spans) == sorted(
        [SPAN_TOKENIZE, SPAN_QUEUE, SPAN_PREFILL, SPAN_KV_TRANSFER, SPAN_DECODE]
    )  # no prefill span of the decode instance's own
    by_name = {s.name: s for s in spans}
    parent = by_name[SPAN_TOKENIZE]
    queue, prefill_span = by_name[SPAN_QUEUE], by_name[SPAN_PREFILL]
    transfer, decode_span = by_name[SPAN_KV_TRANSFER], by_name[SPAN_DECODE]
    for span in (queue, prefill_span, transfer, decode_span):
        assert (span.trace_id, span.parent_span_id) == (parent.trace_id, parent.span_id)
    instance = {s.name: s.attributes["kubesgl.scheduler.instance"] for s in spans if s is not parent}
    assert instance == {
        SPAN_QUEUE: "decode-0", SPAN_PREFILL: "prefill-0", SPAN_KV_TRANSFER: "decode-0", SPAN_DECODE: "decode-0"
    }  # fmt: skip
    assert queue.end_ns <= prefill_span.start_ns <= prefill_span.end_ns <= transfer.start_ns
    assert transfer.start_ns <= decode_span.start_ns and transfer.end_ns <= decode_span.end_ns
    assert prefill_span.attributes["kubesgl.decode.instance"] == "decode-0"
    assert prefill_span.attributes["kubesgl.kv.pages"] == 3
    assert prefill_span.attributes["kubesgl.cached_tokens"] == 8
    attrs = transfer.attributes
    assert (attrs["kubesgl.kv.outcome"], attrs["kubesgl.kv.pages"], attrs["kubesgl.kv.bytes"]) == (
        "ok",
        3,
        3072,
    )
    assert attrs["kubesgl.prefill.instance"] == "prefill-0" and attrs["kubesgl.rid"] == "r1"
    assert all(s.status_code != 2 for s in spans)


def test_no_handoff_in_time_makes_a_failed_transfer_and_the_prefill_here(receiver: OtlpReceiver) -> None:
    tracing = Tracing("kubesgl-scheduler")
    _, decode = telemetry(tracing, "decode-0")
    decode.on_arrival("r1", tokenize_span(tracing), prompt_tokens=12)
    decode.on_remote_prefill("r1")
    decode.on_no_prefill("r1", "prefill-0")  # the prefill instance died: prefilled here
    decode.on_step_start()
    decode.on_outputs([out("r1", [5], 1, finished=True, reason="length")])
    tracing.shutdown()

    spans = receiver.wait_for(lambda s: len(s) == 5, timeout_s=10)
    by_name = {s.name: s for s in spans}
    transfer, prefill = by_name[SPAN_KV_TRANSFER], by_name[SPAN_PREFILL]
    assert (transfer.attributes["kubesgl.kv.outcome"], transfer.status_code) == ("no_prefill", 2)
    assert prefill.attributes["kubesgl.scheduler.instance"] == "decode-0"
    assert transfer.end_ns <= prefill.start_ns


def test_disaggregation_spans_only_under_a_sampled_parent(receiver: OtlpReceiver) -> None:
    """No span under an unsampled parent, and none without a parent: these spans never start a trace."""
    tracing = Tracing("kubesgl-scheduler")
    _, decode = telemetry(tracing, "decode-0")
    _, prefill = telemetry(tracing, "prefill-0")
    unsampled = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00"
    for rid, trace in (("r1", unsampled), ("r2", None)):  # r2: an ask from a decode instance without tracing
        prefill.on_prefill_ask(rid, trace, "decode-0", prompt_tokens=12, received_ns=time.time_ns())
        prefill.on_prefill_done(rid, cached_tokens=0, pages=3)
    decode.on_arrival("r1", {"traceparent": unsampled}, prompt_tokens=12)
    assert decode.on_remote_prefill("r1") == unsampled
    decode.on_transfer("r1", "prefill-0", "ok", pages=3, nbytes=3072, start_ns=1, end_ns=2)
    decode.on_arrival("r2", None, prompt_tokens=12)
    decode.on_transfer("r2", "prefill-0", "ok", pages=3, nbytes=3072, start_ns=1, end_ns=2)
    tracing.shutdown()  # flushes: whatever was recorded and ended has arrived (the queue spans are still open)
    assert receiver.snapshot() == []
