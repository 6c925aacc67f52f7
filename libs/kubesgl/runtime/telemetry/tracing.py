"""OpenTelemetry tracing for kubesgl services: one tracer per service configured by the standard OTEL_*
variables, W3C trace context carried in NATS message headers, and the names of the spans a request makes.

One request is one trace: gateway request -> tokenize -> queue -> prefill -> decode -> detokenize; a
disaggregated request's prefill is the prefill instance's, and a `kv transfer` on the decode instance comes
between it and the decode. Each service starts its spans under the `traceparent` header of the message it
received and puts its own span's `traceparent` on the messages it sends (protocol.headers(..., traceparent=...)).

Tracing is off (a no-op tracer that still passes an incoming trace context through) unless
OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or OTEL_EXPORTER_OTLP_ENDPOINT is set, or when OTEL_SDK_DISABLED=true.
The exporter is OTLP over HTTP/protobuf; its endpoint, headers, timeout and compression, the batch
processor's delays and the sampler (OTEL_TRACES_SAMPLER) all come from the standard variables.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

SPAN_GATEWAY_REQUEST = "gateway request"
SPAN_TOKENIZE = "tokenize"
SPAN_QUEUE = "queue"
SPAN_PREFILL = "prefill"
SPAN_DECODE = "decode"
SPAN_KV_TRANSFER = "kv transfer"
SPAN_DETOKENIZE = "detokenize"

# OpenTelemetry GenAI semantic conventions where one exists, kubesgl.* otherwise.
ATTR_MODEL = "gen_ai.request.model"
ATTR_PROMPT_TOKENS = "gen_ai.usage.input_tokens"
ATTR_OUTPUT_TOKENS = "gen_ai.usage.output_tokens"
ATTR_FINISH_REASON = "gen_ai.response.finish_reasons"
ATTR_CACHED_TOKENS = "kubesgl.cached_tokens"
ATTR_INSTANCE = "kubesgl.scheduler.instance"
ATTR_RID = "kubesgl.rid"
ATTR_SEQ = "kubesgl.seq"
ATTR_TTFT = "kubesgl.ttft_s"  # on the gateway's span: its time to first token, as its histogram saw it
# Disaggregation: the instance of the other role, and a KV pull's pages, their bytes and how it ended.
ATTR_PREFILL_INSTANCE = "kubesgl.prefill.instance"
ATTR_DECODE_INSTANCE = "kubesgl.decode.instance"
ATTR_KV_PAGES = "kubesgl.kv.pages"
ATTR_KV_BYTES = "kubesgl.kv.bytes"
ATTR_KV_OUTCOME = "kubesgl.kv.outcome"

_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
# W3C trace context only: the one header the wire protocol carries.
_PROPAGATOR = TraceContextTextMapPropagator()

Attributes = Mapping[str, AttributeValue]


class Tracing:
    """A service's tracer and the provider that exports its spans. Build one per process, pass it to
    whoever makes spans, and call shutdown() on exit so buffered spans are flushed."""

    def __init__(self, service_name: str) -> None:
        self._provider: TracerProvider | None = None
        if _enabled(os.environ):
            self._provider = TracerProvider(resource=_resource(service_name))
            self._provider.add_span_processor(BatchSpanProcessor(_exporter()))
            self.tracer: trace.Tracer = self._provider.get_tracer("kubesgl")
        else:
            self.tracer = trace.NoOpTracer()

    @property
    def enabled(self) -> bool:
        return self._provider is not None

    def records_under(self, parent_traceparent: str | None) -> bool:
        """Whether a span under this W3C `traceparent` would be recorded: tracing on, a parent (no trace is
        started here) that is sampled, or a sampler that does not follow its parent. What makes a span for
        every delta asks first: a span the sampler drops costs more than the decode it would time."""
        if self._provider is None or not parent_traceparent:
            return False
        if not isinstance(self._provider.sampler, ParentBased):
            return True
        try:
            return bool(int(parent_traceparent.rsplit("-", 1)[1], 16) & 1)  # the flags' sampled bit
        except (IndexError, ValueError):
            return False

    def start_span(
        self,
        name: str,
        parent: Mapping[str, str] | Context | None = None,
        attributes: Attributes | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        start_time_ns: int | None = None,
    ) -> Span:
        """A started span under `parent` (message headers, a Context, or None for a new trace); the
        caller ends it. Spans are never made current: context travels explicitly, in headers."""
        ctx = parent if isinstance(parent, Context) else extract(parent)
        return self.tracer.start_span(
            name, context=ctx, kind=kind, attributes=attributes, start_time=start_time_ns
        )

    @contextmanager
    def span(
        self,
        name: str,
        parent: Mapping[str, str] | Context | None = None,
        attributes: Attributes | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
    ) -> Iterator[Span]:
        """start_span() as a context manager; an exception that escapes marks the span as an error."""
        span = self.start_span(name, parent, attributes, kind)
        try:
            yield span
        except BaseException as e:
            span.record_exception(e)
            span.set_status(Status(StatusCode.ERROR, f"{type(e).__name__}: {e}"))
            raise
        finally:
            span.end()

    def shutdown(self) -> None:
        """Flushes buffered spans and stops the exporter."""
        if self._provider is not None:
            self._provider.shutdown()


def traceparent(span: Span) -> str | None:
    """The W3C `traceparent` header naming `span` as parent, None when it carries no valid context."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier.get("traceparent")


def extract(headers: Mapping[str, str] | None) -> Context:
    """The trace context in message (or HTTP) headers; an empty Context (a new trace) when absent."""
    if not headers:
        return Context()
    return _PROPAGATOR.extract(carrier=headers, context=Context())


def _enabled(env: Mapping[str, str]) -> bool:
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    return any(env.get(v, "").strip() for v in _ENDPOINT_VARS)


def _resource(service_name: str) -> Resource:
    # OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES win; the service's own name is only the default.
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    return resource


def _exporter() -> SpanExporter:
    # Imported here: the OTLP exporter pulls in requests/protobuf, which a service without tracing never needs.
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()
