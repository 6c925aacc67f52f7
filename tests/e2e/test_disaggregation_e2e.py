"""Prefill/decode disaggregation through the whole stack: one prefill and one decode scheduler (KV through
NIXL over host memory), tracing to a real OTLP endpoint. A request sent under a client's trace context makes one
trace with the prefill instance's prefill span, the decode instance's kv transfer and decode spans, in the place
the colocated prefill and decode take. The pair gives the greedy completions one `both` scheduler gives (chunked
prompts, a shared prefix, n=2, JSON mode, prompt logprobs); a prefill instance killed with requests in flight
loses none (the decode instance prefills them itself after --disaggregation-timeout, generous here: a CPU
prefill instance's first prompts are slow). One stack serves both tests; the second kills its prefill instance,
so it runs last (tests/run.sh keeps a file's tests in order on one worker). The chart's prefill/decode board
(dashboards/roles/) charts these two instances, scraped under the pod names the role StatefulSets give them:
every query has data."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from kubesgl.launcher import ServiceProcess, Stack
from support.dashboard_queries import concrete, dashboards, exprs
from support.otlp_receiver import OtlpReceiver, ReceivedSpan
from support.prometheus_server import PrometheusServer

pytest.importorskip("nixl_cu12", reason="NIXL (the disagg extra) is not installed")

ARGS = (
    *TEST_SCHEDULER_ARGS,
    "--page-size",
    "4",
    "--max-prefill-length",
    "24",
    # Generous: under a loaded CI box a CPU prefill instance's first prompts (a JSON grammar's compile among
    # them) are slow, and a decode instance that gave up on a live prefill instance would fail the
    # no-fallback check. The kill below is noticed by the heartbeat expiry (~3 s), not by this timeout.
    "--disaggregation-timeout",
    "300",
)
SHARED = "You are a careful assistant who answers briefly about the weather in mountain towns. "
BODIES: list[dict[str, Any]] = [
    {"prompt": SHARED + "What about Zermatt in winter?", "max_tokens": 8},
    {"prompt": SHARED + "And Chamonix in spring, when the snow melts?", "max_tokens": 8, "n": 2},
    {"prompt": "Hi", "max_tokens": 6},
    {"prompt": "Count: one two three four five six seven", "max_tokens": 5, "echo": True, "logprobs": 1},
    {"prompt": "Give me a JSON object.", "max_tokens": 12, "response_format": {"type": "json_object"}},
]


CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture(scope="module")
def pd_stack(
    stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, OtlpReceiver]]:
    """As `kubesgl up --prefill 1 --decode 1` starts them, every service exporting its spans to `receiver`."""
    with OtlpReceiver() as receiver:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_BSP_SCHEDULE_DELAY": "100"}
        stack = stack_factory(
            tmp_path_factory.mktemp("stack"),
            schedulers=0,
            prefill_schedulers=1,
            decode_schedulers=1,
            scheduler_args=ARGS,
            env=env,
        )
        try:
            yield stack, receiver
        finally:
            stack.stop(timeout_s=10)


def _complete(url: str, body: dict[str, Any], headers: dict[str, str] | None = None) -> list[Any]:
    body = {"model": "demo", "temperature": 0, **body}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [(c["text"], c["finish_reason"], (c.get("logprobs") or {}).get("tokens")) for c in choices]


def _run_all(url: str) -> list[list[Any]]:
    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        return list(pool.map(lambda b: _complete(url, b), BODIES))


def _one(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    [span] = [s for s in spans if s.name == name]
    return span


def test_a_disaggregated_request_traces_its_prefill_transfer_and_decode(
    pd_stack: tuple[Stack, OtlpReceiver],
) -> None:
    stack, receiver = pd_stack
    prefill, decode = [s for s in stack.services.values() if s.kind == "scheduler"]
    headers = {"traceparent": f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"}
    # Longer than a page, so the decode instance pulls KV.
    assert _complete(stack.gateway_urls[0], {**BODIES[0], "max_tokens": 4}, headers)[0][1] == "length"
    stages = {"gateway request", "tokenize", "queue", "prefill", "kv transfer", "decode", "detokenize"}

    def complete(spans: list[ReceivedSpan]) -> bool:
        return {s.name for s in spans if s.trace_id == CLIENT_TRACE} >= stages

    receiver.wait_for(complete, timeout_s=30)
    spans = [s for s in receiver.snapshot() if s.trace_id == CLIENT_TRACE]
    tokenize, prefill_span = (
        _one(spans, "tokenize"),
        _one(spans, "prefill"),
    )  # one prefill: the prefill instance's
    queue, transfer, decode_span = _one(spans, "queue"), _one(spans, "kv transfer"), _one(spans, "decode")
    # Where the colocated trace has its queue -> prefill -> decode: under the tokenizer's span.
    for span in (queue, prefill_span, transfer, decode_span):
        assert span.parent_span_id == tokenize.span_id, span.name
    assert {s.parent_span_id for s in spans if s.name == "detokenize"} == {decode_span.span_id}
    assert all(s.service == "kubesgl-scheduler" for s in (queue, prefill_span, transfer, decode_span))
    instance = "kubesgl.scheduler.instance"
    assert prefill_span.attributes[instance] == prefill.instance_id
    assert prefill_span.attributes["kubesgl.decode.instance"] == decode.instance_id
    assert queue.attributes[instance] == transfer.attributes[instance] == decode.instance_id
    assert decode_span.attributes[instance] == decode.instance_id
    assert transfer.attributes["kubesgl.prefill.instance"] == prefill.instance_id
    assert transfer.attributes["kubesgl.kv.outcome"] == "ok"
    assert transfer.attributes["kubesgl.kv.pages"] > 0 and transfer.attributes["kubesgl.kv.bytes"] > 0
    assert prefill_span.attributes["kubesgl.kv.pages"] == transfer.attributes["kubesgl.kv.pages"]
    # In time: the decode instance asks, the prefill instance computes and hands off, the pull runs as the
    # first token is reported (one host: one clock).
    assert queue.end_ns <= prefill_span.start_ns <= prefill_span.end_ns <= transfer.start_ns
    assert transfer.start_ns <= decode_span.start_ns and transfer.end_ns <= decode_span.end_ns
    assert all(s.status_code != 2 for s in spans), [s.name for s in spans if s.status_code == 2]


def test_prefill_and_decode_instances_match_one_colocated_instance(
    pd_stack: tuple[Stack, OtlpReceiver], tmp_path: Path
) -> None:
    stack, _ = pd_stack
    url = stack.gateway_urls[0]
    prefill, decode = [s for s in stack.services.values() if s.kind == "scheduler"]
    assert "prefill" in prefill.proc.args and "decode" in decode.proc.args
    got = _run_all(url)
    # Every request's prompt was computed by the prefill instance, its KV pulled by the decode instance.
    assert _metric(prefill.metrics_url, "kubesgl_pd_handoffs_total") >= len(BODIES)
    assert _metric(decode.metrics_url, "kubesgl_pd_transfer_bytes_total") > 0
    assert _metric(decode.metrics_url, "kubesgl_pd_transfer_duration_seconds_count") >= 1
    assert _metric(decode.metrics_url, "kubesgl_pd_fallbacks_total") == 0
    assert _empty_role_board_queries(prefill, decode, tmp_path / "prometheus") == []

    # The prefill instance dies with requests in flight: the decode instance prefills them; none is lost.
    with concurrent.futures.ThreadPoolExecutor(len(BODIES)) as pool:
        futures = [pool.submit(_complete, url, b) for b in BODIES]
        prefill.proc.kill()
        after_kill = [f.result() for f in futures]
    assert _metric(decode.metrics_url, "kubesgl_pd_fallbacks_total") > 0

    # The reference: one scheduler serving whole requests, the same flags.
    decode.proc.terminate()
    decode.proc.wait(30)
    both = stack.spawn("scheduler")
    stack.wait_ready(180, [both.name])
    want = [_complete(url, b) for b in BODIES]
    assert got == want
    assert after_kill == want


def _metric(url: str, name: str) -> float:
    """The sum of a metric's samples on one /metrics page (0 when it has none yet)."""
    text = httpx.get(url, timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    )


def _empty_role_board_queries(prefill: ServiceProcess, decode: ServiceProcess, workdir: Path) -> list[str]:
    """The role board's queries that return nothing when a Prometheus scrapes the two instances as the chart's
    <release>-scheduler-prefill-0 and -decode-0 pods."""
    workdir.mkdir()
    jobs = [
        {
            "job_name": f"kubesgl-scheduler-{role}",
            "static_configs": [
                {
                    "targets": [svc.metrics_url.removeprefix("http://").removesuffix("/metrics")],
                    "labels": {"namespace": "llm", "pod": f"kubesgl-scheduler-{role}-0"},
                }
            ],
        }
        for role, svc in (("prefill", prefill), ("decode", decode))
    ]
    prometheus = PrometheusServer(workdir, targets={}, scrape_configs=jobs)
    try:
        prometheus.wait_ready()
        # Three scrapes of both: rate() over the window has its two samples.
        prometheus.wait_for("min(count_over_time(up[1m])) >= 3 and min(up) == 1", bool, timeout_s=30)
        board = dashboards()["kubesgl-disaggregation.json"]
        return [e for e in exprs(board) if not prometheus.query(concrete(e, rate_interval="1m"))]
    finally:
        prometheus.stop()
