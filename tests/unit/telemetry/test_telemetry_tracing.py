"""Tracing setup from OTEL_* variables and W3C trace context across message headers, checked at a real
OTLP/HTTP endpoint."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubesgl.runtime.telemetry.tracing import SPAN_DETOKENIZE, SPAN_TOKENIZE, Tracing, extract, traceparent
from support.otlp_receiver import OtlpReceiver

OTEL_VARS = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_SAMPLER",
)
PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


@pytest.fixture
def receiver(monkeypatch: pytest.MonkeyPatch) -> Iterator[OtlpReceiver]:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    with OtlpReceiver() as r:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", r.endpoint)
        yield r


def test_tracing_is_off_without_an_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in OTEL_VARS:
        monkeypatch.delenv(var, raising=False)
    tracing = Tracing("kubesgl-tokenizer")
    assert not tracing.enabled
    # Off still passes an upstream trace through, so a hop without tracing does not break the trace.
    with tracing.span(SPAN_TOKENIZE, parent={"traceparent": PARENT}) as span:
        assert traceparent(span) == PARENT
    with tracing.span(SPAN_TOKENIZE) as span:
        assert traceparent(span) is None


def test_sdk_disabled_wins_over_an_endpoint(receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert not Tracing("kubesgl-gateway").enabled


def test_spans_reach_the_otlp_endpoint_named_for_the_service(receiver: OtlpReceiver) -> None:
    tracing = Tracing("kubesgl-tokenizer")
    assert tracing.enabled
    with tracing.span(SPAN_TOKENIZE, attributes={"gen_ai.request.model": "m"}):
        pass
    tracing.shutdown()
    [span] = receiver.wait_for(lambda s: len(s) == 1, timeout_s=10)
    assert (span.service, span.name, span.parent_span_id) == ("kubesgl-tokenizer", SPAN_TOKENIZE, "")
    assert span.attributes["gen_ai.request.model"] == "m"


def test_traces_endpoint_variable_alone_enables_tracing(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint + "/v1/traces")
    tracing = Tracing("kubesgl-detokenizer")
    with tracing.span(SPAN_DETOKENIZE):
        pass
    tracing.shutdown()
    receiver.wait_for(lambda s: [x.name for x in s] == [SPAN_DETOKENIZE], timeout_s=10)


def test_otel_service_name_overrides_the_default(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_SERVICE_NAME", "tokenizer-eu-west")
    tracing = Tracing("kubesgl-tokenizer")
    with tracing.span(SPAN_TOKENIZE):
        pass
    tracing.shutdown()
    [span] = receiver.wait_for(lambda s: len(s) == 1, timeout_s=10)
    assert span.service == "tokenizer-eu-west"


def test_traceparent_header_makes_the_next_service_span_a_child(receiver: OtlpReceiver) -> None:
    upstream, downstream = Tracing("kubesgl-gateway"), Tracing("kubesgl-tokenizer")
    with upstream.span("gateway request") as root:
        headers = {"kubesgl-rid": "r1", "traceparent": traceparent(root)}
    with downstream.span(SPAN_TOKENIZE, parent=headers):
        pass
    upstream.shutdown()
    downstream.shutdown()
    spans = receiver.wait_for(lambda s: len(s) == 2, timeout_s=10)
    by_name = {s.name: s for s in spans}
    root_span, child = by_name["gateway request"], by_name[SPAN_TOKENIZE]
    assert child.trace_id == root_span.trace_id
    assert child.parent_span_id == root_span.span_id
    assert (root_span.service, child.service) == ("kubesgl-gateway", "kubesgl-tokenizer")


def test_an_escaping_exception_marks_the_span_as_error(receiver: OtlpReceiver) -> None:
    tracing = Tracing("kubesgl-detokenizer")
    with pytest.raises(ValueError), tracing.span(SPAN_DETOKENIZE):
        raise ValueError("bad delta")
    tracing.shutdown()
    [span] = receiver.wait_for(lambda s: len(s) == 1, timeout_s=10)
    assert span.status_code == 2


def test_headers_without_traceparent_start_a_new_trace() -> None:
    for headers in (None, {}, {"kubesgl-rid": "r1"}, {"traceparent": "garbage"}):
        assert not extract(headers)


def test_a_span_per_delta_is_worth_making_only_under_a_sampled_parent(
    receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    tracing = Tracing("kubesgl-detokenizer")
    assert tracing.records_under(PARENT)
    unsampled = PARENT[:-2] + "00"
    for parent in (unsampled, None, "", "garbage"):  # dropped by the sampler, or a trace of its own per delta
        assert not tracing.records_under(parent)
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "always_on")  # a sampler that does not follow the parent
    assert Tracing("kubesgl-detokenizer").records_under(unsampled)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT")
    assert not Tracing("kubesgl-detokenizer").records_under(PARENT)  # tracing off
