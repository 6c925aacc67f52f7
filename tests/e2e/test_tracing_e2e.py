"""One request through the running local stack makes one trace whose spans come from all four services:
gateway request -> tokenize -> queue -> prefill -> decode -> detokenize, received by a real OTLP endpoint."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import pytest
from conftest import StackFactory
from support.local_stack import model_name, stream_chat
from support.otlp_receiver import OtlpReceiver, ReceivedSpan

pytestmark = pytest.mark.slow

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
SERVICES = {"kubesgl-gateway", "kubesgl-tokenizer", "kubesgl-scheduler", "kubesgl-detokenizer"}
STAGES = ["gateway request", "tokenize", "queue", "prefill", "decode", "detokenize"]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def trace(
    stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, list[ReceivedSpan]]]:
    """The spans of one streamed chat completion sent under a client's trace context, and the model name."""
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",  # export within 0.1 s instead of 5 s
        }
        stack = stack_factory(tmp_path_factory.mktemp("stack"), env=env)
        try:
            model = model_name(stack)
            headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
            with httpx.Client(base_url=stack.gateway_urls[0], headers=headers, timeout=120) as client:
                events = stream_chat(client, model, "Say hello", MAX_TOKENS, ignore_eos=True)
            assert events[-1]["usage"]["completion_tokens"] == MAX_TOKENS

            def complete(spans: list[ReceivedSpan]) -> bool:
                mine = [s for s in spans if s.trace_id == CLIENT_TRACE]
                detokenized = [s for s in mine if s.name == "detokenize"]
                return (
                    {s.service for s in mine} == SERVICES
                    and {s.name for s in mine} >= set(STAGES)
                    and (
                        len(detokenized) >= 2  # the first delta's and the last's
                    )
                )

            receiver.wait_for(complete, timeout_s=30)
            time.sleep(0.5)  # five export periods: a span per delta, were there one, would be here by now
            yield model, [s for s in receiver.snapshot() if s.trace_id == CLIENT_TRACE]
        finally:
            stack.stop(timeout_s=10)


def one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    [span] = [s for s in spans if s.name == name]
    return span


def test_one_request_makes_one_trace_across_all_four_services(trace: tuple[str, list[ReceivedSpan]]) -> None:
    _, spans = trace
    assert {s.service for s in spans} == SERVICES
    by_stage = {name: {s.service for s in spans if s.name == name} for name in STAGES}
    assert by_stage == {
        "gateway request": {"kubesgl-gateway"},
        "tokenize": {"kubesgl-tokenizer"},
        "queue": {"kubesgl-scheduler"},
        "prefill": {"kubesgl-scheduler"},
        "decode": {"kubesgl-scheduler"},
        "detokenize": {"kubesgl-detokenizer"},
    }


def test_spans_form_one_tree_under_the_client_span(trace: tuple[str, list[ReceivedSpan]]) -> None:
    _, spans = trace
    gateway, tokenize, decode = one(spans, "gateway request"), one(spans, "tokenize"), one(spans, "decode")
    assert gateway.parent_span_id == CLIENT_SPAN
    assert tokenize.parent_span_id == gateway.span_id
    for stage in ("queue", "prefill", "decode"):
        assert one(spans, stage).parent_span_id == tokenize.span_id
    # Every TokenDelta carries the decode span's context, so each detokenize span hangs under it. Only the first
    # delta and the last get one (a span per delta was hundreds per trace).
    detokenized = [s for s in spans if s.name == "detokenize"]
    assert {s.parent_span_id for s in detokenized} == {decode.span_id}
    seqs = sorted(int(s.attributes["kubesgl.seq"]) for s in detokenized)
    assert len(seqs) == 2 and seqs[0] == 0 and seqs[1] > 0, seqs
    ids = {s.span_id for s in spans} | {CLIENT_SPAN}
    assert all(s.parent_span_id in ids for s in spans)


def test_stages_follow_each_other_in_time(trace: tuple[str, list[ReceivedSpan]]) -> None:
    _, spans = trace
    gateway, tokenize = one(spans, "gateway request"), one(spans, "tokenize")
    queue, prefill, decode = one(spans, "queue"), one(spans, "prefill"), one(spans, "decode")
    assert gateway.start_ns <= tokenize.start_ns <= queue.start_ns
    assert queue.end_ns == prefill.start_ns <= prefill.end_ns == decode.start_ns <= decode.end_ns
    assert decode.end_ns <= gateway.end_ns
    assert all(s.status_code != 2 for s in spans), [s.name for s in spans if s.status_code == 2]


def test_spans_carry_the_request_attributes(trace: tuple[str, list[ReceivedSpan]]) -> None:
    model, spans = trace
    assert one(spans, "gateway request").attributes["gen_ai.request.model"] == model
    prefill, decode = one(spans, "prefill"), one(spans, "decode")
    assert prefill.attributes["gen_ai.usage.input_tokens"] > 0
    assert prefill.attributes["kubesgl.cached_tokens"] >= 0
    assert decode.attributes["gen_ai.usage.output_tokens"] == MAX_TOKENS
    assert decode.attributes["gen_ai.response.finish_reasons"] == ["length"]
    instance = decode.attributes["kubesgl.scheduler.instance"]
    assert instance.startswith("scheduler-0")
    assert one(spans, "queue").attributes["kubesgl.scheduler.instance"] == instance
    rids = {s.attributes.get("kubesgl.rid") for s in spans if s.name in ("queue", "detokenize")}
    assert len(rids) == 1 and None not in rids
