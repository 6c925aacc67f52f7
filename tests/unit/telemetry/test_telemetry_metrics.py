"""The Prometheus metrics each service exports: SGLang's scheduler metrics and the kubesgl_* service metrics."""

from __future__ import annotations

import asyncio
import random
import re

import pytest
from kubesgl.runtime.telemetry import metrics as metrics_module
from kubesgl.runtime.telemetry.metrics import (
    DetokenizerMetrics,
    DisaggregationMetrics,
    GatewayMetrics,
    HistogramTally,
    NatsMetrics,
    SchedulerMetrics,
    StageMetrics,
    TokenizerMetrics,
    new_registry,
    render,
)
from kubesgl.values.outputs import EngineStats
from prometheus_client import CollectorRegistry, Histogram
from support.dashboard_queries import exported_labels
from support.operator_scrape import RESERVED_LABELS

MODEL = {"model_name": "qwen3-tiny"}

# Copied from SGLang (python/sglang/srt/metrics/collector.py) so a change to ours is caught here.
# SGLang's boundaries, preceded by ours from 1 ms (SGLang's start at 0.1 s for TTFT, 2 ms for ITL).
FROM_1MS = [0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075]
SGLANG_TTFT = [*FROM_1MS, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
SGLANG_ITL = [
    0.001,
    0.002,
    0.004,
    0.006,
    0.008,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.035,
    0.04,
    0.06,
    0.08,
    0.1,
    0.2,
    0.4,
]
SGLANG_ITL += [0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0]
SGLANG_E2E = [
    0.1,
    0.2,
    0.4,
    0.6,
    0.8,
    1,
    2,
    4,
    6,
    8,
    10,
    20,
    40,
    60,
    80,
    100,
    200,
    400,
    600,
    1200,
    1800,
    2400,
]


class FakeClock:
    """Stands in for time.monotonic so windows can be stepped exactly."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stats(running: int = 0, queued: int = 0, available: int = 100, total: int = 100) -> EngineStats:
    return EngineStats(
        num_running=running,
        num_queued=queued,
        free_pages=available,
        available_pages=available,
        total_pages=total,
        cached_prefix_pages=0,
    )


def scheduler(clock: FakeClock | None = None) -> tuple[CollectorRegistry, SchedulerMetrics]:
    registry = CollectorRegistry()
    return registry, SchedulerMetrics(
        registry, "qwen3-tiny", page_size=16, num_pages=100, clock=clock or FakeClock()
    )


def bucket_bounds(registry: CollectorRegistry, name: str) -> list[float]:
    text = render(registry)[0].decode()
    bounds = re.findall(rf'^{re.escape(name)}_bucket\{{[^}}]*le="([^"]+)"', text, flags=re.M)
    return [float(b) for b in bounds if b != "+Inf"]


def exposition(registry: CollectorRegistry, names: tuple[str, ...] = ("",)) -> dict[tuple[str, str], float]:
    """The registry's samples whose names start with one of `names`, by name and labels (no `_created`)."""
    return {
        (s.name, repr(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
        if s.name.startswith(names) and not s.name.endswith("_created")
    }


def assert_same_exposition(got: dict[tuple[str, str], float], want: dict[tuple[str, str], float]) -> None:
    """The same samples with the same values; a histogram's `_sum` to float64 rounding, since it adds the same
    terms in another order or as n x v (sums of at most a few hundred terms: 1e-12 relative is far above it)."""
    assert got.keys() == want.keys()
    for key, value in want.items():
        assert got[key] == (pytest.approx(value, rel=1e-12) if key[0].endswith("_sum") else value), key


def test_scheduler_histograms_use_sglang_names_and_buckets_from_1ms() -> None:
    registry, m = scheduler()
    m.on_first_token(0.5, 10, 0)
    m.on_tokens(2, 0.01)
    m.on_finished(1.0, "stop")
    assert bucket_bounds(registry, "sglang:time_to_first_token_seconds") == SGLANG_TTFT
    assert bucket_bounds(registry, "sglang:inter_token_latency_seconds") == SGLANG_ITL
    assert bucket_bounds(registry, "sglang:e2e_request_latency_seconds") == SGLANG_E2E


def test_a_steps_tokens_recorded_together_equal_them_recorded_one_request_at_a_time() -> None:
    """A step's intervals are mostly one value (the time since the step before), which on_step_tokens counts
    once: the step below has a few such values, some requests' first tokens (no interval) and some requests
    with several tokens."""
    rng = random.Random(3)
    since = [rng.uniform(0.001, 0.05) for _ in range(3)]
    step = [
        (rng.choice([1, 1, 1, 2, 4]), rng.choice([None, *since, rng.uniform(0.001, 0.05)])) for _ in range(64)
    ]
    generated = sum(n for n, _ in step)
    intervals = [interval / n for n, interval in step if interval is not None for _ in range(n)]
    together, one_by_one = scheduler(), scheduler()
    together[1].on_step_tokens(generated, intervals)
    for n, interval in step:
        one_by_one[1].on_tokens(n, interval)
    names = ("sglang:generation_tokens_total", "sglang:inter_token_latency_seconds")
    got, want = exposition(together[0], names), exposition(one_by_one[0], names)
    assert len(want) > 3
    assert_same_exposition(got, want)


def test_cache_config_info_names_page_size_and_pages() -> None:
    registry, _ = scheduler()
    labels = {**MODEL, "page_size": "16", "num_pages": "100"}
    assert registry.get_sample_value("sglang:cache_config_info", labels) == 1


def test_first_token_counts_prompt_and_cached_tokens() -> None:
    registry, m = scheduler()
    m.on_first_token(0.3, prompt_tokens=40, cached_tokens=32)
    m.on_tokens(1, None)
    assert registry.get_sample_value("sglang:prompt_tokens_total", MODEL) == 40
    assert registry.get_sample_value("sglang:cached_tokens_total", MODEL) == 32
    assert registry.get_sample_value("sglang:generation_tokens_total", MODEL) == 1
    assert registry.get_sample_value("sglang:time_to_first_token_seconds_count", MODEL) == 1
    assert registry.get_sample_value("sglang:time_to_first_token_seconds_bucket", {**MODEL, "le": "0.2"}) == 0
    assert registry.get_sample_value("sglang:time_to_first_token_seconds_bucket", {**MODEL, "le": "0.4"}) == 1
    # The first token has no inter-token interval.
    assert registry.get_sample_value("sglang:inter_token_latency_seconds_count", MODEL) == 0


def test_inter_token_interval_is_spread_over_its_tokens() -> None:
    registry, m = scheduler()
    m.on_tokens(4, 0.08)
    assert registry.get_sample_value("sglang:inter_token_latency_seconds_count", MODEL) == 4
    assert registry.get_sample_value("sglang:inter_token_latency_seconds_sum", MODEL) == pytest.approx(0.08)
    assert (
        registry.get_sample_value("sglang:inter_token_latency_seconds_bucket", {**MODEL, "le": "0.015"}) == 0
    )
    assert (
        registry.get_sample_value("sglang:inter_token_latency_seconds_bucket", {**MODEL, "le": "0.02"}) == 4
    )
    assert registry.get_sample_value("sglang:generation_tokens_total", MODEL) == 4


def test_step_sets_running_queued_and_token_usage() -> None:
    registry, m = scheduler()
    m.on_step(stats(running=3, queued=5, available=25, total=100))
    assert registry.get_sample_value("sglang:num_running_reqs", MODEL) == 3
    assert registry.get_sample_value("sglang:num_queue_reqs", MODEL) == 5
    assert registry.get_sample_value("sglang:token_usage", MODEL) == pytest.approx(0.75)


def test_step_sets_the_tokens_still_to_prefill() -> None:
    """What a prefill instance's KEDA trigger reads (scheduler.roles.prefill.autoscaling in the chart)."""
    registry, m = scheduler()
    m.on_step(EngineStats(0, 2, 100, 100, 100, 0, pending_prefill_tokens=5000))
    assert registry.get_sample_value("kubesgl_scheduler_pending_prefill_tokens", MODEL) == 5000
    m.on_step(stats())
    assert registry.get_sample_value("kubesgl_scheduler_pending_prefill_tokens", MODEL) == 0


def test_fallback_series_start_at_zero_for_each_reason() -> None:
    """So the first fallback is an increase KubesglPdFallbackStorm's rate() sees, not a series born counted."""
    registry = CollectorRegistry()
    m = DisaggregationMetrics(registry)
    for reason in ("no_prefill", "transfer"):
        assert registry.get_sample_value("kubesgl_pd_fallbacks_total", {"reason": reason}) == 0
    m.fallbacks.labels(reason="transfer").inc()
    assert registry.get_sample_value("kubesgl_pd_fallbacks_total", {"reason": "transfer"}) == 1


def test_gen_throughput_and_cache_hit_rate_cover_the_last_window() -> None:
    clock = FakeClock()
    registry, m = scheduler(clock)
    m.on_first_token(0.1, prompt_tokens=100, cached_tokens=25)
    m.on_tokens(50, None)
    clock.now += 0.5
    m.on_step(stats())  # inside the window: nothing computed yet
    assert registry.get_sample_value("sglang:gen_throughput", MODEL) == 0
    clock.now += 1.5
    m.on_step(stats())
    assert registry.get_sample_value("sglang:gen_throughput", MODEL) == pytest.approx(25.0)
    assert registry.get_sample_value("sglang:cache_hit_rate", MODEL) == pytest.approx(0.25)
    # An idle window: throughput decays to 0, the hit rate of the last prefills stays.
    clock.now += 1.0
    m.on_step(stats())
    assert registry.get_sample_value("sglang:gen_throughput", MODEL) == 0
    assert registry.get_sample_value("sglang:cache_hit_rate", MODEL) == pytest.approx(0.25)


def test_abort_counts_as_request_and_aborted() -> None:
    registry, m = scheduler()
    m.on_finished(2.0, "stop")
    m.on_finished(3.0, "abort")
    assert registry.get_sample_value("sglang:num_requests_total", MODEL) == 2
    assert registry.get_sample_value("sglang:num_aborted_requests_total", MODEL) == 1
    assert registry.get_sample_value("sglang:e2e_request_latency_seconds_count", MODEL) == 2


def test_two_services_in_one_process_keep_separate_metrics() -> None:
    (r1, m1), (r2, _) = scheduler(), scheduler()
    m1.on_tokens(3, None)
    assert r1.get_sample_value("sglang:generation_tokens_total", MODEL) == 3
    assert r2.get_sample_value("sglang:generation_tokens_total", MODEL) == 0
    # Tokenizer, detokenizer and gateway can also share one registry without name clashes.
    shared = CollectorRegistry()
    TokenizerMetrics(shared)
    DetokenizerMetrics(CollectorRegistry())
    GatewayMetrics(CollectorRegistry())


def test_stage_tracks_status_latency_and_in_flight() -> None:
    registry = CollectorRegistry()
    stage = StageMetrics(registry, "tokenizer")
    with stage.track() as outcome:
        assert registry.get_sample_value("kubesgl_tokenizer_requests_in_flight") == 1
        outcome.status = 400
    with stage.track():
        pass
    with pytest.raises(RuntimeError), stage.track():
        raise RuntimeError("boom")
    assert registry.get_sample_value("kubesgl_tokenizer_requests_in_flight") == 0
    assert registry.get_sample_value("kubesgl_tokenizer_requests_total", {"status": "400"}) == 1
    assert registry.get_sample_value("kubesgl_tokenizer_requests_total", {"status": "200"}) == 1
    assert registry.get_sample_value("kubesgl_tokenizer_requests_total", {"status": "500"}) == 1
    assert registry.get_sample_value("kubesgl_tokenizer_request_duration_seconds_count") == 3


class TimeoutError(Exception):  # noqa: A001 - the name nats-py's timeout carries
    """Named like nats.errors.TimeoutError, which the outcome label is derived from."""


class NoRespondersError(Exception):
    """Named like nats.errors.NoRespondersError."""


def test_nats_request_outcome_follows_the_exception() -> None:
    registry = CollectorRegistry()
    nats = NatsMetrics(registry, "gateway")
    with nats.request("tokenize"):
        pass
    for error in (TimeoutError, NoRespondersError, ValueError):
        with pytest.raises(error), nats.request("tokenize"):
            raise error()
    nats.on_reconnect()

    def count(outcome: str) -> float | None:
        labels = {"component": "gateway", "target": "tokenize", "outcome": outcome}
        return registry.get_sample_value("kubesgl_nats_request_duration_seconds_count", labels)

    assert [count(o) for o in ("ok", "timeout", "no_responders", "error")] == [1, 1, 1, 1]
    assert registry.get_sample_value("kubesgl_nats_reconnects_total", {"component": "gateway"}) == 1


def test_gateway_request_records_ttft_itl_and_status_once() -> None:
    registry = CollectorRegistry()
    gw = GatewayMetrics(registry)
    req = gw.request("qwen3-tiny", "/v1/chat/completions")
    assert registry.get_sample_value("kubesgl_gateway_requests_in_flight", {"model": "qwen3-tiny"}) == 1
    req.on_tokens(1)
    req.on_tokens(3)
    req.on_tokens(0)
    req.finish(200)
    req.finish(500)  # a second exit path: ignored
    model = {"model": "qwen3-tiny"}
    route = {**model, "route": "/v1/chat/completions"}
    assert registry.get_sample_value("kubesgl_gateway_requests_in_flight", model) == 0
    assert registry.get_sample_value("kubesgl_gateway_time_to_first_token_seconds_count", model) == 1
    assert registry.get_sample_value("kubesgl_gateway_inter_token_latency_seconds_count", model) == 3
    assert registry.get_sample_value("kubesgl_gateway_completion_tokens_total", model) == 4
    assert registry.get_sample_value("kubesgl_gateway_requests_total", {**route, "status": "200"}) == 1
    assert registry.get_sample_value("kubesgl_gateway_requests_total", {**route, "status": "500"}) is None
    assert registry.get_sample_value("kubesgl_gateway_request_duration_seconds_count", route) == 1


def test_gateway_requests_of_several_models_routes_and_statuses_keep_their_series_apart() -> None:
    """The labelled children are looked up once per (model, route) and status: each request still lands in its own."""
    registry = CollectorRegistry()
    gw = GatewayMetrics(registry)
    cases = [("a", "/v1/completions", 200), ("a", "/v1/chat/completions", 200), ("b", "/v1/completions", 400)]
    cases += [("a", "/v1/completions", 499), ("a", "/v1/completions", 200), ("b", "/v1/completions", 200)]
    open_ = [gw.request(m, r) for m, r, _ in cases]
    assert registry.get_sample_value("kubesgl_gateway_requests_in_flight", {"model": "a"}) == 4
    assert registry.get_sample_value("kubesgl_gateway_requests_in_flight", {"model": "b"}) == 2
    for req, (_, _, status) in zip(open_, cases, strict=True):
        req.on_tokens(2)
        req.finish(status)
    for (m, r, status), n in {
        ("a", "/v1/completions", 200): 2,
        ("a", "/v1/chat/completions", 200): 1,
        ("b", "/v1/completions", 400): 1,
        ("a", "/v1/completions", 499): 1,
        ("b", "/v1/completions", 200): 1,
    }.items():
        labels = {"model": m, "route": r, "status": str(status)}
        assert registry.get_sample_value("kubesgl_gateway_requests_total", labels) == n, labels
    for m, n in (("a", 4), ("b", 2)):
        assert registry.get_sample_value("kubesgl_gateway_requests_in_flight", {"model": m}) == 0
        assert registry.get_sample_value("kubesgl_gateway_completion_tokens_total", {"model": m}) == 2 * n
        assert (
            registry.get_sample_value("kubesgl_gateway_time_to_first_token_seconds_count", {"model": m}) == n
        )
    duration = "kubesgl_gateway_request_duration_seconds_count"
    assert registry.get_sample_value(duration, {"model": "a", "route": "/v1/completions"}) == 3
    assert registry.get_sample_value(duration, {"model": "a", "route": "/v1/chat/completions"}) == 1
    assert registry.get_sample_value(duration, {"model": "b", "route": "/v1/completions"}) == 2


async def test_gateway_tokens_of_a_loop_turn_are_counted_together_when_it_ends(monkeypatch) -> None:
    """In an event loop the token counter and ITL histogram take a turn's tokens when it ends; the exposition
    then equals counting each at once (as outside a loop). The time to first token is observed at once."""
    clock = [100.0]
    monkeypatch.setattr(metrics_module.time, "perf_counter", lambda: clock[0])
    rng = random.Random(5)
    in_loop, direct = CollectorRegistry(), CollectorRegistry()
    a, b = GatewayMetrics(in_loop), GatewayMetrics(direct)
    pairs = [
        (a.request(f"m{i % 2}", "/v1/completions"), b.request(f"m{i % 2}", "/v1/completions"))
        for i in range(8)
    ]
    plan = [[rng.randint(1, 3) for _ in pairs] for _ in range(3)]
    tokens = {"model": "m0"}
    for turn, counts in enumerate(plan):
        clock[0] += rng.uniform(0.001, 0.05)
        for (ra, _), n in zip(pairs, counts, strict=True):
            ra.on_tokens(n)
        ttft = in_loop.get_sample_value("kubesgl_gateway_time_to_first_token_seconds_count", tokens)
        assert ttft == 4  # at once
        before = in_loop.get_sample_value("kubesgl_gateway_completion_tokens_total", tokens)
        assert before == sum(n for c in plan[:turn] for n in c[::2])  # this turn's: not yet
        await asyncio.sleep(0)  # the turn ends
        assert in_loop.get_sample_value("kubesgl_gateway_completion_tokens_total", tokens) == sum(
            n for c in plan[: turn + 1] for n in c[::2]
        )

        def outside_the_loop(counts: list[int] = counts) -> None:
            for (_, rb), n in zip(pairs, counts, strict=True):
                rb.on_tokens(n)

        await asyncio.to_thread(outside_the_loop)

    names = ("kubesgl_gateway_completion_tokens", "kubesgl_gateway_inter_token")
    got, want = exposition(in_loop, names), exposition(direct, names)
    assert len(want) > 4
    assert_same_exposition(got, want)


def test_render_serves_prometheus_text_with_process_metrics() -> None:
    registry = new_registry()
    SchedulerMetrics(registry, "qwen3-tiny", page_size=1, num_pages=10)
    body, content_type = render(registry)
    assert content_type.startswith("text/plain; version=0.0.4")
    text = body.decode()
    assert 'sglang:num_running_reqs{model_name="qwen3-tiny"} 0.0' in text
    assert "process_resident_memory_bytes" in text


def test_capacity_and_startup_gauges_under_sglang_names() -> None:
    registry = CollectorRegistry()
    m = SchedulerMetrics(
        registry, "qwen3-tiny", 16, 100, clock=FakeClock(), startup_s=42.5, load_weights_s=30.25
    )
    assert registry.get_sample_value("sglang:max_total_num_tokens", MODEL) == 1600
    assert registry.get_sample_value("sglang:engine_startup_time", MODEL) == 42.5
    assert registry.get_sample_value("sglang:engine_load_weights_time", MODEL) == 30.25
    # Used tokens: pages held by running requests (evictable prefix cache is available, not used).
    m.on_step(stats(available=75, total=100))
    assert registry.get_sample_value("sglang:num_used_tokens", MODEL) == 25 * 16


def test_retractions_count_once_and_the_gauge_covers_the_last_window() -> None:
    clock = FakeClock()
    registry, m = scheduler(clock)

    def step(retracted_total: int) -> None:
        s = stats()
        s.retracted_total = retracted_total
        m.on_step(s)

    step(3)
    step(3)  # the same total again: nothing new
    assert registry.get_sample_value("sglang:num_retracted_requests_total", MODEL) == 3
    clock.now += 1.5
    step(5)
    assert registry.get_sample_value("sglang:num_retracted_requests_total", MODEL) == 5
    # SGLang's gauge: retracted since the last window.
    assert registry.get_sample_value("sglang:num_retracted_reqs", MODEL) == 5
    clock.now += 1.5
    step(5)
    assert registry.get_sample_value("sglang:num_retracted_reqs", MODEL) == 0


def test_no_metric_label_collides_with_a_scrape_target_label() -> None:
    """A label named like one the Prometheus Operator's scrape sets (service, endpoint, instance, ...) is stored
    as exported_<name>, and every alert or board selecting it reads nothing."""
    labels = exported_labels()
    assert labels["kubesgl_nats_reconnects_total"] == {"component"}
    for name, names in labels.items():
        assert not names & RESERVED_LABELS, (name, names & RESERVED_LABELS)


@pytest.mark.parametrize("labelled", [False, True])
def test_a_histogram_tally_gives_the_exposition_of_observing_n_times(labelled: bool) -> None:
    rng = random.Random(7)
    bounds = (0.001, 0.002, 0.004, 0.01, 0.1, 1.0)
    registries = (CollectorRegistry(), CollectorRegistry())

    def make(registry: CollectorRegistry) -> Histogram:
        h = Histogram("x_seconds", "x", ["model"] if labelled else [], buckets=bounds, registry=registry)
        return h.labels(model="m") if labelled else h

    many, one_by_one = make(registries[0]), make(registries[1])
    # Values on the bounds too (le is inclusive), and above the last one (+Inf).
    values = [*bounds, 0.0, 5.0, *(rng.uniform(0, 0.02) for _ in range(50))]
    gathered = HistogramTally(many)
    for v in values:
        n = rng.randint(1, 5)
        gathered.add(v, n)
        for _ in range(n):
            one_by_one.observe(v)
    gathered.flush()

    assert_same_exposition(exposition(registries[0]), exposition(registries[1]))
