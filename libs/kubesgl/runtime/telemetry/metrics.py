"""Every Prometheus metric kubesgl exports: one small class per service, bound to the registry it is given.

Schedulers export SGLang's model-server metrics under SGLang's names, help texts, buckets and `model_name`
label, so whatever already reads an SGLang server (the Gateway API inference extension's endpoint picker,
KEDA queries, SGLang's Grafana boards) reads a kubesgl scheduler unchanged. Gateway, tokenizer and
detokenizer export `kubesgl_*` metrics: requests by status, latency histograms, in-flight gauges and the
round-trip latency of their NATS requests.

Registries are passed in, never the process-global default, so two services (or two tests) in one
process never share a metric.

Multiple processes: a scheduler pod with TP > 1 runs one process per GPU, but only rank 0 drives the
engine loop: it admits every request, receives every output and reads the page pool, while ranks 1..N-1
run the same batches on their weight shards in lockstep. Rank 0 alone therefore owns a SchedulerMetrics
and serves /metrics; its numbers are the whole instance's, and exporting from the other ranks would only
repeat them (a `sum` over pods would double count). Tokenizer and detokenizer run one process per pod and
scale by replicas, which Prometheus tells apart by their pod label. A gateway pod may run several worker
processes on one port (`--workers`, services/gateway/workers.py): they use prometheus_client's multiprocess
mode, so the /metrics any worker answers is the pod's sum (`multiprocess_registry`), and the dashboards'
`process_*` series come once per worker under a `worker` label, which `sum by (pod)` adds up.

Label names: none is a label a scrape attaches to every target (the Prometheus Operator's `job`, `instance`,
`namespace`, `pod`, `container`, `service`, `endpoint`, `node`). Prometheus would rename ours to
`exported_<name>` (honor_labels off, the operator's default) or let ours overwrite the target's (on), so the
service making a NATS request is `component`, the gateway's HTTP route `route`, and the router's scheduler
instance `scheduler_instance`.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from prometheus_client import (
    CONTENT_TYPE_PLAIN_0_0_4,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.gc_collector import GCCollector
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.platform_collector import PlatformCollector
from prometheus_client.process_collector import ProcessCollector

from kubesgl.runtime.loop_local import LoopLocal
from kubesgl.values.outputs import EngineStats

# SGLang's default buckets (python/sglang/srt/metrics/collector.py, TokenizerMetricsCollector), with finer
# ones below them down to 1 ms: on a fast model (and the demo) 88 % of TTFTs fell in SGLang's first, 0.1 s,
# bucket, so every quantile under it was a guess. Every SGLang boundary is kept, so a query or board written
# against SGLang's `le` values reads these unchanged.
_SUB_100MS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.025, 0.05, 0.075)
TTFT_BUCKETS = (*_SUB_100MS, 0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400)
# fmt: off
ITL_BUCKETS = (
    0.001, 0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040,
    0.060, 0.080, 0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0,
)
E2E_BUCKETS = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400,
)
# fmt: on
# Service-internal latencies: a hop is milliseconds, a whole request can take a minute.
SERVICE_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
NATS_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class HistogramTally:
    """Observations of one histogram gathered without a lock (a bisection and a dict entry each) and added in one
    step by `flush`: one increment per bucket used and one for the sum, where observing each took three locked
    increments and a Python loop over the buckets. It writes the labelled child's value cells, which
    prometheus_client has kept as `_sum` / `_buckets` / `_upper_bounds` since its histograms began; without
    them (another version), or for a NaN, `flush` observes each value."""

    def __init__(self, histogram: Histogram) -> None:
        self._histogram = histogram
        self._bounds: tuple[float, ...] | None = getattr(histogram, "_upper_bounds", None)
        self._counts: dict[int, int] = {}
        self._sum = 0.0
        self._values: list[tuple[float, int]] = []  # without the cells, or for a NaN

    def add(self, amount: float, n: int = 1) -> None:
        """`amount`, `n` times."""
        if self._bounds is None or amount != amount:
            self._values.append((amount, n))
            return
        i = bisect.bisect_left(self._bounds, amount)
        self._counts[i] = self._counts.get(i, 0) + n
        self._sum += amount * n

    def flush(self) -> None:
        h = self._histogram
        if self._counts:
            h._sum.inc(self._sum)  # type: ignore[attr-defined]
            buckets = h._buckets  # type: ignore[attr-defined]
            for i, n in self._counts.items():
                buckets[i].inc(n)
        for amount, n in self._values:
            for _ in range(n):
                h.observe(amount)
        self._counts, self._sum, self._values = {}, 0.0, []


def new_registry() -> CollectorRegistry:
    """A fresh registry for one service, with the process, GC and platform collectors."""
    registry = CollectorRegistry(auto_describe=True)
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    PlatformCollector(registry=registry)
    return registry


def multiprocess_registry(worker_pids: Callable[[], dict[int, int]]) -> CollectorRegistry:
    """What a worker of a multi-process service renders: every worker's metrics, summed from
    PROMETHEUS_MULTIPROC_DIR, and each worker's process_* series labelled `worker` (`worker_pids` gives
    index -> pid). prometheus_client has no GC metrics in this mode."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry)
    registry.register(_WorkerProcesses(worker_pids))
    return registry


class _WorkerProcesses:
    """ProcessCollector's series for several processes, one `worker` label value each."""

    def __init__(self, worker_pids: Callable[[], dict[int, int]]) -> None:
        self._worker_pids = worker_pids

    def collect(self) -> Iterator[Metric]:
        families: dict[str, Metric] = {}
        for worker, pid in sorted(self._worker_pids().items()):
            for family in ProcessCollector(pid=lambda pid=pid: pid, registry=None).collect():
                out = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
                for sample in family.samples:
                    out.add_sample(sample.name, {**sample.labels, "worker": str(worker)}, sample.value)
        yield from families.values()


def render(registry: CollectorRegistry) -> tuple[bytes, str]:
    """The /metrics response body and its content type (text format 0.0.4, which every scraper reads)."""
    return generate_latest(registry), CONTENT_TYPE_PLAIN_0_0_4


class SchedulerMetrics:
    """SGLang's scheduler and request metrics for one scheduler instance (rank 0 only, see module doc)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        model_name: str,
        page_size: int,
        num_pages: int,
        window_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
        startup_s: float = 0.0,
        load_weights_s: float = 0.0,
    ) -> None:
        label = {"model_name": model_name}
        names = ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, names, registry=registry).labels(**label)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=registry).labels(**label)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, names, buckets=buckets, registry=registry).labels(**label)

        self.num_running_reqs = gauge("sglang:num_running_reqs", "The number of running requests.")
        self.num_queue_reqs = gauge("sglang:num_queue_reqs", "The number of requests in the waiting queue.")
        # Ours (SGLang has none): the prefill work waiting, in tokens; what a prefill instance scales on (a
        # request count weighs a 100-token prompt like a 32k one).
        self.pending_prefill_tokens = gauge(
            "kubesgl_scheduler_pending_prefill_tokens",
            "Tokens still to prefill: the queued requests' (before prefix-cache hits) and the rest of running "
            "chunked prefills.",
        )
        self.token_usage = gauge("sglang:token_usage", "The token usage.")
        self.cache_hit_rate = gauge("sglang:cache_hit_rate", "The prefix cache hit rate.")
        self.gen_throughput = gauge("sglang:gen_throughput", "The generation throughput (token/s).")
        info = Gauge(
            "sglang:cache_config_info",
            "Information of the KV cache: page size (tokens) and number of pages.",
            ["model_name", "page_size", "num_pages"],
            registry=registry,
        )
        info.labels(model_name=model_name, page_size=str(page_size), num_pages=str(num_pages)).set(1)
        # Capacity and start-up, as SGLang names them: set once, from what this engine really measured.
        self._page_size = page_size
        self.max_total_num_tokens = gauge(
            "sglang:max_total_num_tokens", "Maximum total number of tokens in the KV cache pool."
        )
        self.max_total_num_tokens.set(num_pages * page_size)
        self.num_used_tokens = gauge("sglang:num_used_tokens", "The number of used tokens.")
        gauge("sglang:engine_startup_time", "The time taken for the engine to start up.").set(startup_s)
        gauge("sglang:engine_load_weights_time", "The time taken for the engine to load weights.").set(
            load_weights_s
        )
        # Preemptions: SGLang's gauge (retracted since the previous window) and its counter.
        self.num_retracted_reqs = gauge("sglang:num_retracted_reqs", "The number of retracted requests.")
        self.num_retracted_requests = counter(
            "sglang:num_retracted_requests_total", "Number of retracted (preempted) requests."
        )
        self._retracted_seen = 0
        self._retracted_window = 0
        self.prompt_tokens = counter("sglang:prompt_tokens_total", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "sglang:generation_tokens_total", "Number of generation tokens processed."
        )
        self.cached_tokens = counter("sglang:cached_tokens_total", "Number of cached prompt tokens.")
        self.num_requests = counter("sglang:num_requests_total", "Number of requests processed.")
        self.num_aborted_requests = counter(
            "sglang:num_aborted_requests_total", "Number of requests aborted."
        )
        self.ttft = histogram(
            "sglang:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = histogram(
            "sglang:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.e2e = histogram(
            "sglang:e2e_request_latency_seconds",
            "Histogram of End-to-end request latency in seconds",
            E2E_BUCKETS,
        )
        self.nats = NatsMetrics(registry, "scheduler")
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._totals = _TokenTotals()
        self._window_start = clock()
        self._window_totals = _TokenTotals()

    def on_first_token(self, ttft_s: float, prompt_tokens: int, cached_tokens: int) -> None:
        """A request's prefill finished and produced its first token(s)."""
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt_tokens)
        self.cached_tokens.inc(cached_tokens)
        with self._lock:
            self._totals.prompt += prompt_tokens
            self._totals.cached += cached_tokens

    def on_tokens(self, n: int, interval_s: float | None) -> None:
        """`n` new tokens of one request; `interval_s` since its previous ones (None for the first)."""
        self.on_step_tokens(n, [interval_s / n] * n if interval_s is not None and n > 0 else [])

    def on_step_tokens(self, generated: int, intervals: list[float]) -> None:
        """One step's `generated` tokens, and the inter-token interval of each that had one (like SGLang, a
        request's interval spread evenly over the tokens it delivered). The counter takes the step in one
        increment, the ITL histogram in one per bucket used: a step's intervals are mostly one value, the time
        since the step before, so they are counted by value first."""
        if generated:
            self.generation_tokens.inc(generated)
            with self._lock:
                self._totals.generated += generated
        if intervals:
            itl = HistogramTally(self.itl)
            for value, n in collections.Counter(intervals).items():
                itl.add(value, n)
            itl.flush()

    def on_finished(self, e2e_s: float, finish_reason: str | None) -> None:
        """A request ended: normally, by a limit, or aborted."""
        self.e2e.observe(e2e_s)
        self.num_requests.inc()
        if finish_reason == "abort":
            self.num_aborted_requests.inc()

    def on_step(self, stats: EngineStats) -> None:
        """Engine gauges; call at least once per window (e.g. every heartbeat) so rates decay to 0 when idle."""
        self.num_running_reqs.set(stats.num_running)
        self.num_queue_reqs.set(stats.num_queued)
        self.pending_prefill_tokens.set(stats.pending_prefill_tokens)
        self.token_usage.set(stats.token_usage)
        self.num_used_tokens.set((stats.total_pages - stats.available_pages) * self._page_size)
        now = self._clock()
        with self._lock:
            if stats.retracted_total > self._retracted_seen:
                self.num_retracted_requests.inc(stats.retracted_total - self._retracted_seen)
                self._retracted_seen = stats.retracted_total
            elapsed = now - self._window_start
            if elapsed < self._window_s:
                return
            delta = self._totals.minus(self._window_totals)
            self._window_start, self._window_totals = now, self._totals.copy()
            retracted, self._retracted_window = (
                self._retracted_seen - self._retracted_window,
                self._retracted_seen,
            )
        self.num_retracted_reqs.set(retracted)
        self.gen_throughput.set(delta.generated / elapsed)
        # Like SGLang, the rate of the latest prefills; kept as is while nothing is prefilled.
        if delta.prompt > 0:
            self.cache_hit_rate.set(delta.cached / delta.prompt)


class _TokenTotals:
    """Token counts since start, kept beside the counters so windows can difference them."""

    def __init__(self, prompt: int = 0, cached: int = 0, generated: int = 0) -> None:
        self.prompt, self.cached, self.generated = prompt, cached, generated

    def copy(self) -> _TokenTotals:
        return _TokenTotals(self.prompt, self.cached, self.generated)

    def minus(self, other: _TokenTotals) -> _TokenTotals:
        return _TokenTotals(
            self.prompt - other.prompt, self.cached - other.cached, self.generated - other.generated
        )


class NatsMetrics:
    """Round-trip latency and outcome of a service's NATS requests, and its reconnects."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self._rtt = Histogram(
            "kubesgl_nats_request_duration_seconds",
            "Round trip of a NATS request until its reply, by target subject kind and outcome.",
            ["component", "target", "outcome"],
            buckets=NATS_LATENCY_BUCKETS,
            registry=registry,
        )
        self._reconnects = Counter(
            "kubesgl_nats_reconnects_total", "Reconnections to NATS.", ["component"], registry=registry
        ).labels(component=service)
        self._service = service

    @contextmanager
    def request(self, target: str) -> Iterator[None]:
        """Times one request/reply to `target` ("tokenize", "generate", "detok", ...); the outcome is
        "ok", or derived from the exception that escapes (which is re-raised)."""
        start = time.perf_counter()
        outcome = "ok"
        try:
            yield
        except BaseException as e:
            outcome = _outcome(e)
            raise
        finally:
            self._rtt.labels(component=self._service, target=target, outcome=outcome).observe(
                time.perf_counter() - start
            )

    def on_reconnect(self) -> None:
        self._reconnects.inc()


def _outcome(error: BaseException) -> str:
    # By class name so this module needs no NATS import; nats-py raises TimeoutError / NoRespondersError.
    name = type(error).__name__
    if "Timeout" in name:
        return "timeout"
    if "NoResponders" in name:
        return "no_responders"
    if name == "CancelledError":
        return "cancelled"
    return "error"


class StageMetrics:
    """Requests by status, their latency and how many are in flight, for one NATS-driven service."""

    def __init__(self, registry: CollectorRegistry, service: str) -> None:
        self._requests = Counter(
            f"kubesgl_{service}_requests_total",
            f"Messages the {service} handled, by status.",
            ["status"],
            registry=registry,
        )
        self._duration = Histogram(
            f"kubesgl_{service}_request_duration_seconds",
            f"Time the {service} spent on one message until its reply.",
            buckets=SERVICE_LATENCY_BUCKETS,
            registry=registry,
        )
        self._in_flight = Gauge(
            f"kubesgl_{service}_requests_in_flight",
            f"Messages the {service} is handling now.",
            registry=registry,
        )

    @contextmanager
    def track(self) -> Iterator[RequestStatus]:
        """Wraps the handling of one message; set `.status` to the HTTP-style code it ended with (an
        exception that escapes counts as 500)."""
        status = RequestStatus()
        start = time.perf_counter()
        self._in_flight.inc()
        try:
            yield status
        except BaseException:
            status.status = 500
            raise
        finally:
            self._in_flight.dec()
            self._duration.observe(time.perf_counter() - start)
            self._requests.labels(status=str(status.status)).inc()


class RequestStatus:
    """The outcome of one tracked request, filled in by the handler."""

    def __init__(self) -> None:
        self.status = 200


class TokenizerMetrics:
    """The tokenizer: its requests (tokenize + admission at a scheduler), tokenization time, routing, NATS."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = StageMetrics(registry, "tokenizer")
        self.nats = NatsMetrics(registry, "tokenizer")
        self.router = RouterMetrics(registry)
        self._tokenize = Histogram(
            "kubesgl_tokenizer_tokenize_duration_seconds",
            "CPU time to apply the chat template and tokenize one prompt.",
            buckets=SERVICE_LATENCY_BUCKETS,
            registry=registry,
        )
        self._prompt_tokens = Counter(
            "kubesgl_tokenizer_prompt_tokens_total", "Prompt tokens produced.", registry=registry
        )

    def on_tokenized(self, seconds: float, prompt_tokens: int) -> None:
        self._tokenize.observe(seconds)
        self._prompt_tokens.inc(prompt_tokens)


ROUTING_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05)
OVERLAP_BUCKETS = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0)


class RouterMetrics:
    """The tokenizer's routing decisions and, for cache-aware routing, its prefix index of the instances."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._decisions = Counter(
            "kubesgl_router_decisions_total",
            "Routing decisions by policy and outcome (prefix: the chosen instance held part of the prompt; "
            "load: no usable overlap; affinity: the session's instance).",
            ["policy", "outcome"],
            registry=registry,
        )
        self._latency = Histogram(
            "kubesgl_router_decision_duration_seconds",
            "Time to pick an instance for one request (hashing the prompt's blocks included).",
            buckets=ROUTING_LATENCY_BUCKETS,
            registry=registry,
        )
        self._overlap = Histogram(
            "kubesgl_router_prefix_overlap_ratio",
            "Share of the request's prompt blocks cached at the chosen instance, per cache-aware decision.",
            buckets=OVERLAP_BUCKETS,
            registry=registry,
        )
        self._index_blocks = Gauge(
            "kubesgl_router_index_blocks",
            "Prefix blocks the routing index holds per scheduler instance.",
            ["scheduler_instance"],
            registry=registry,
        )
        self._index_size = Gauge(
            "kubesgl_router_index_size", "Distinct prefix blocks in the routing index.", registry=registry
        )
        self._snapshots = Counter(
            "kubesgl_router_kv_snapshots_total",
            "KV snapshots requested from scheduler instances (late start, reconnect, lost events), by outcome.",
            ["outcome"],
            registry=registry,
        )
        self._indexed: set[str] = set()

    def on_decision(self, policy: str, outcome: str, seconds: float, overlap: float | None) -> None:
        self._decisions.labels(policy=policy, outcome=outcome).inc()
        self._latency.observe(seconds)
        if overlap is not None:
            self._overlap.observe(overlap)

    def on_index(self, blocks_by_instance: dict[str, int], size: int) -> None:
        for gone in self._indexed - blocks_by_instance.keys():
            self._index_blocks.remove(gone)
        for instance, n in blocks_by_instance.items():
            self._index_blocks.labels(scheduler_instance=instance).set(n)
        self._indexed = set(blocks_by_instance)
        self._index_size.set(size)

    def on_snapshot(self, outcome: str) -> None:
        self._snapshots.labels(outcome=outcome).inc()


class DetokenizerMetrics:
    """The detokenizer: the TokenDeltaBatches it handled (one message each) by status and latency, tokens
    decoded, NATS."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = StageMetrics(registry, "detokenizer")
        self.nats = NatsMetrics(registry, "detokenizer")
        self._tokens = Counter(
            "kubesgl_detokenizer_tokens_total", "New tokens turned into text.", registry=registry
        )

    def on_decoded(self, new_tokens: int) -> None:
        self._tokens.inc(new_tokens)


class GatewayMetrics:
    """The gateway: client requests by model, endpoint and status; client-side TTFT/ITL; NATS requests."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.nats = NatsMetrics(registry, "gateway")
        self.migrations = MigrationMetrics(registry)
        self._requests = Counter(
            "kubesgl_gateway_requests_total",
            "HTTP requests answered, by model, route and status code.",
            ["model", "route", "status"],
            registry=registry,
        )
        self._duration = Histogram(
            "kubesgl_gateway_request_duration_seconds",
            "HTTP request latency until the last byte, by model and route.",
            ["model", "route"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self._in_flight = Gauge(
            "kubesgl_gateway_requests_in_flight",
            "HTTP requests being answered now.",
            ["model"],
            registry=registry,
            multiprocess_mode="livesum",  # a multi-process gateway's pod: the sum over its live workers
        )
        self._by_key: dict[tuple[str, str], _RequestSeries] = {}
        # Same buckets as the scheduler's sglang:* histograms so the two can be compared bucket by bucket.
        self._ttft = Histogram(
            "kubesgl_gateway_time_to_first_token_seconds",
            "Streamed requests: time from the HTTP request's arrival (before its body is read) to sending its "
            "first token (a non-streamed answer sends every token at once: see the request duration).",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self._itl = Histogram(
            "kubesgl_gateway_inter_token_latency_seconds",
            "Time between tokens as sent to the client.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self._tokens = Counter(
            "kubesgl_gateway_completion_tokens_total",
            "Completion tokens sent to clients.",
            ["model"],
            registry=registry,
        )

    def request(self, model: str, endpoint: str, start: float | None = None) -> GatewayRequestMetrics:
        """Starts timing one HTTP request. `model` must be a served model id or "unknown" (an arbitrary
        client string would make label values unbounded); `endpoint` the route, e.g. "/v1/chat/completions";
        `start` the request's arrival (time.perf_counter(); default now)."""
        return GatewayRequestMetrics(self, model, endpoint, start)

    def _series(self, model: str, route: str) -> _RequestSeries:
        """The labelled children a request of (model, route) writes, looked up once per label set: a labels()
        call costs ~1 µs, seven a request. Bounded as the label values are (served models, routes)."""
        series = self._by_key.get((model, route))
        if series is None:
            series = self._by_key[model, route] = _RequestSeries(self, model, route)
        return series


class _RequestSeries:
    """One (model, route)'s labelled children; the requests counter's by status, as statuses occur."""

    def __init__(self, m: GatewayMetrics, model: str, route: str) -> None:
        self.ttft = m._ttft.labels(model=model)
        self.itl = m._itl.labels(model=model)
        self.tokens = m._tokens.labels(model=model)
        self.in_flight = m._in_flight.labels(model=model)
        self.duration = m._duration.labels(model=model, route=route)
        self._requests = m._requests
        self._model, self._route = model, route
        self._by_status: dict[int, Counter] = {}

    def requests(self, status: int) -> Counter:
        counter = self._by_status.get(status)
        if counter is None:
            counter = self._by_status[status] = self._requests.labels(
                model=self._model, route=self._route, status=str(status)
            )
        return counter


class MigrationMetrics:
    """The gateway's request migrations (a choice moved off a dead scheduler instance): how many, how long."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._migrated = Counter(
            "kubesgl_requests_migrated_total",
            "Choices whose scheduler instance died mid-stream, re-admitted elsewhere with their output so far "
            "(outcome migrated), or that could not be (outcome failed: budget spent, no instance admitted it).",
            ["outcome"],
            registry=registry,
        )
        self._seconds = Histogram(
            "kubesgl_request_migration_duration_seconds",
            "From the gateway declaring the instance dead to another instance admitting the resumed choice "
            "(the pause the client sees is this plus the heartbeat expiry before it, and the re-prefill after).",
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        for outcome in ("migrated", "failed"):
            # Both series exist from the start at 0, so the first migration is an increase that rate() and
            # increase() (KubesglMigrationStorm) see, not a series appearing already counted.
            self._migrated.labels(outcome)

    def on_migration(self, outcome: str, seconds: float) -> None:
        self._migrated.labels(outcome).inc()
        if outcome == "migrated":
            self._seconds.observe(seconds)


class _TurnTokens:
    """The tokens the gateway's streams sent in one turn of its event loop, added to their counters and ITL
    histograms in one step when the turn ends (where a write each took three locked increments): the turn's
    first `count` schedules the flush. One per loop (`_turns`); outside a loop, `_TurnTokens(deferred=False)`
    is flushed by its user at once."""

    def __init__(self, deferred: bool = True) -> None:
        self.deferred = deferred
        self._counts: dict[Counter, int] = {}
        self._tallies: dict[Histogram, HistogramTally] = {}

    def count(self, counter: Counter, n: int) -> None:
        if not self._counts and self.deferred:  # the turn's first: flush when it ends
            asyncio.get_running_loop().call_soon(self.flush)
        self._counts[counter] = self._counts.get(counter, 0) + n

    def observe(self, histogram: Histogram, amount: float, n: int) -> None:
        tally = self._tallies.get(histogram)
        if tally is None:
            tally = self._tallies[histogram] = HistogramTally(histogram)
        tally.add(amount, n)

    def flush(self) -> None:
        counts, self._counts = self._counts, {}
        for counter, n in counts.items():
            counter.inc(n)
        for tally in self._tallies.values():
            tally.flush()


_turns = LoopLocal(_TurnTokens)


class GatewayRequestMetrics:
    """One HTTP request's timer: in flight from creation until finish(). Its labelled series are looked up
    once here, not per token (a labels() call cost more than the observation it selects)."""

    def __init__(
        self, metrics: GatewayMetrics, model: str, endpoint: str, start: float | None = None
    ) -> None:
        self._start = time.perf_counter() if start is None else start
        self._last_token: float | None = None
        self._finished = False
        series = self._series = metrics._series(model, endpoint)
        self._ttft, self._itl, self._tokens = series.ttft, series.itl, series.tokens
        self.tokens = 0  # completion tokens sent so far
        self.ttft_s: float | None = None
        # The loop's _TurnTokens, looked up at the first tokens (a request runs in one loop).
        self._turn: _TurnTokens | None = None
        series.in_flight.inc()

    def on_tokens(self, n: int) -> None:
        """`n` new tokens were sent to the client (the first call is the time to first token, observed at once).
        The token counter and the ITL histogram take each loop turn's tokens, of every stream, together
        (_TurnTokens); outside an event loop, at once."""
        if n <= 0:
            return
        now = time.perf_counter()
        self.tokens += n
        turn = self._turn
        if turn is None:
            # Outside an event loop there is none: each call gets a turn of its own, flushed below.
            turn = self._turn = _turns.running()
            if turn is None:
                turn = _TurnTokens(deferred=False)
        turn.count(self._tokens, n)
        if self._last_token is None:
            self.ttft_s = now - self._start
            self._ttft.observe(self.ttft_s)
        else:
            turn.observe(self._itl, (now - self._last_token) / n, n)
        self._last_token = now
        if not turn.deferred:
            turn.flush()

    def on_answer(self, n: int) -> None:
        """A non-streamed answer carried `n` tokens: counted, but no time to first token (its first token
        reaches the client with the last one, so that time would be the request's duration again)."""
        self.tokens += n
        self._tokens.inc(n)

    def finish(self, status: int) -> None:
        """The response ended with HTTP `status` (for a stream: 200, or the error status sent in it).
        Only the first call counts, so every exit path may call it."""
        if self._finished:
            return
        self._finished = True
        series = self._series
        series.in_flight.dec()
        series.duration.observe(time.perf_counter() - self._start)
        series.requests(status).inc()


class DisaggregationMetrics:
    """A prefill or decode instance's KV handoffs (services/scheduler/pd.py)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.handoffs = Counter(
            "kubesgl_pd_handoffs_total",
            "Prompts this prefill instance computed and handed to a decode instance (their KV described).",
            registry=registry,
        )
        self.transfer_bytes = Counter(
            "kubesgl_pd_transfer_bytes_total",
            "KV bytes this decode instance pulled from prefill instances through NIXL.",
            registry=registry,
        )
        self.transfer_seconds = Histogram(
            "kubesgl_pd_transfer_duration_seconds",
            "One request's KV pull, from its handoff's arrival to the pages in place.",
            buckets=SERVICE_LATENCY_BUCKETS,
            registry=registry,
        )
        self.fallbacks = Counter(
            "kubesgl_pd_fallbacks_total",
            "Requests this decode instance prefilled itself (no_prefill: no handoff in time; transfer: the KV "
            "pull failed, was late or found no room).",
            ["reason"],
            registry=registry,
        )
        for reason in ("no_prefill", "transfer"):
            # Both series exist from the start at 0: the first fallback is an increase that rate() and
            # KubesglPdFallbackStorm see, and the dashboards chart 0 rather than nothing.
            self.fallbacks.labels(reason)
