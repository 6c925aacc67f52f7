"""A real Prometheus scrapes the running local stack while requests flow: the scheduler's SGLang metrics
and every service's kubesgl_* metrics arrive, and the dashboards' PromQL returns data (the prefill/decode board's:
tests/e2e/test_disaggregation_e2e.py, whose stack has those roles)."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from conftest import StackFactory
from kubesgl.launcher import Stack
from support.dashboard_queries import concrete, dashboards, exprs, metric_names
from support.local_stack import BackgroundLoad, metrics_targets, model_name
from support.prometheus_server import PrometheusServer

pytestmark = pytest.mark.slow

LOAD_S = 5.0
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def scraped(
    stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[Stack, PrometheusServer]]:
    stack = stack_factory(tmp_path_factory.mktemp("stack"))
    try:
        prometheus = PrometheusServer(tmp_path_factory.mktemp("prometheus"), metrics_targets(stack))
        try:
            prometheus.wait_ready()
            # Every target scraped once before the load, so increase() sees all of it.
            prometheus.wait_for("sum(up) == 4", lambda r: len(r) == 1, timeout_s=30)
            # Load long enough for several 1 s scrapes to see requests running.
            with BackgroundLoad(
                stack.gateway_urls[0], model_name(stack), users=3, max_tokens=MAX_TOKENS
            ) as load:
                time.sleep(LOAD_S)  # scenario timing: the load runs this long under 1 s scrapes
                prometheus.wait_for(
                    "max_over_time(sglang:num_running_reqs[1m]) >= 1", lambda r: len(r) > 0, timeout_s=60
                )
                prometheus.wait_for(
                    'sum(kubesgl_gateway_requests_total{status="200"}) >= 3',
                    lambda r: len(r) > 0,
                    timeout_s=90,
                )
            assert not load.errors, load.errors[:5]
            # Two more scrapes after the load, so counters hold every request that finished.
            prometheus.wait_for("sglang:num_running_reqs == 0", lambda r: len(r) == 1, timeout_s=30)
            yield stack, prometheus
        finally:
            prometheus.stop()
    finally:
        stack.stop(timeout_s=10)


def scalar(prometheus: PrometheusServer, expr: str) -> float:
    result = prometheus.query(expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


def test_every_service_is_scraped(scraped: tuple[Stack, PrometheusServer]) -> None:
    _, prometheus = scraped
    up = {r["metric"]["job"]: r["value"][1] for r in prometheus.query("up")}
    assert up == {"gateway": "1", "tokenizer": "1", "detokenizer": "1", "scheduler": "1"}


def test_ttft_quantile_from_scheduler_histogram(scraped: tuple[Stack, PrometheusServer]) -> None:
    stack, prometheus = scraped
    model = model_name(stack)
    selector = f'sglang:time_to_first_token_seconds_bucket{{model_name="{model}"}}'
    p90 = scalar(prometheus, f"histogram_quantile(0.9, sum by (le) (increase({selector}[5m])))")
    assert 0 < p90 <= 400
    assert scalar(prometheus, f'sum(sglang:time_to_first_token_seconds_count{{model_name="{model}"}})') >= 3
    # Buckets are SGLang's: the first finite bound is 100 ms.
    les = {r["metric"]["le"] for r in prometheus.query(selector)}
    assert {"0.1", "400.0", "+Inf"} <= les


def test_running_requests_were_seen(scraped: tuple[Stack, PrometheusServer]) -> None:
    stack, prometheus = scraped
    [series] = prometheus.query(
        f'max_over_time(sglang:num_running_reqs{{model_name="{model_name(stack)}"}}[5m])'
    )
    assert 1 <= float(series["value"][1]) <= 3


def test_token_counters_agree_across_services(scraped: tuple[Stack, PrometheusServer]) -> None:
    _, prometheus = scraped
    # The last deltas reach the detokenizer and gateway after the scheduler finishes: give the counters a
    # few scrapes to settle (they must then agree exactly).
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        counts = [
            scalar(prometheus, q)
            for q in (
                "sum(sglang:generation_tokens_total)",
                "sum(kubesgl_detokenizer_tokens_total)",
                "sum(kubesgl_gateway_completion_tokens_total)",
            )
        ]
        if len(set(counts)) == 1:
            break
        time.sleep(1)
    generated = scalar(prometheus, "sum(sglang:generation_tokens_total)")
    streamed = scalar(prometheus, "sum(kubesgl_gateway_completion_tokens_total)")
    detokenized = scalar(prometheus, "sum(kubesgl_detokenizer_tokens_total)")
    assert generated >= 3 * MAX_TOKENS
    # Every generated token was detokenized and streamed (ignore_eos: no stop token is held back).
    assert detokenized == generated
    assert streamed == generated
    prompt = scalar(prometheus, "sum(sglang:prompt_tokens_total)")
    assert prompt == scalar(prometheus, "sum(kubesgl_tokenizer_prompt_tokens_total)")


def test_dashboard_queries_return_data(scraped: tuple[Stack, PrometheusServer]) -> None:
    _, prometheus = scraped
    # Series that exist only after a failure, a reconnect or an abort may be empty after a clean run.
    only_on_failure = ('outcome!="ok"', "reconnects", "aborted", 'status=~"5..', 'status=~"[45]..')
    empty = []
    for name, dash in dashboards(roles=False).items():
        for expr in exprs(dash):
            if any(marker in expr for marker in only_on_failure):
                continue
            if not prometheus.query(concrete(expr, rate_interval="5m")):
                empty.append(f"{name}: {expr}")
    assert not empty, "dashboard queries without data:\n" + "\n".join(empty)


def test_every_dashboard_metric_is_scraped(scraped: tuple[Stack, PrometheusServer]) -> None:
    _, prometheus = scraped
    scraped_names = set(prometheus.api("label/__name__/values"))
    used = {n for dash in dashboards(roles=False).values() for e in exprs(dash) for n in metric_names(e)}
    assert not used - scraped_names, f"charted but never scraped: {sorted(used - scraped_names)}"
