"""Request migration: a choice whose scheduler instance died mid-stream goes on elsewhere.

The gateway keeps what a resume needs because it already holds every choice's state: the client connection,
the request as the tokenizer got it, and the token ids it streamed (TextDelta.token_ids). A migration sends
that request again through the tokenizers with `output_ids` = the tokens streamed so far (a resume admission:
GenerateRequest.output_ids), under a new internal rid so that a late delta of the dead instance's run cannot
be taken for the new one's. The new instance prefills prompt + output and continues at the next output
position; seeded and greedy sampling give the tokens the dead instance would have (docs/reliability.md).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

from kubesgl.protocol import TokenizeRequest
from kubesgl.runtime.telemetry.metrics import MigrationMetrics
from kubesgl.runtime.telemetry.tracing import Tracing

log = logging.getLogger("kubesgl.gateway")

DEFAULT_MAX_MIGRATIONS = 3
DEFAULT_MAX_MIGRATION_SECONDS = 30.0


@dataclass(frozen=True)
class MigrationPolicy:
    """A choice's migration budget: how often it may move (`max_migrations`; 0 = never: its stream fails with
    the instance) and how much pause the moves may add to its stream (`max_seconds`: from its last delta before
    its instance was declared dead to the resumed admission, summed over its moves); and where migrations are
    counted and traced."""

    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    metrics: MigrationMetrics | None = None
    tracing: Tracing | None = None
    max_seconds: float = DEFAULT_MAX_MIGRATION_SECONDS

    def started(self, rid: str, instance: str, resumed: int, traceparent: str | None) -> Migration:
        log.warning(
            "request %s: scheduler instance %s stopped responding; migrating it with %d output tokens",
            rid,
            instance,
            resumed,
        )
        span = None
        if self.tracing is not None and self.tracing.records_under(traceparent):
            assert traceparent is not None
            span = self.tracing.start_span(
                "migrate",
                {"traceparent": traceparent},
                {"kubesgl.rid": rid, "kubesgl.from_instance": instance, "kubesgl.resumed_tokens": resumed},
            )
        return Migration(self, time.monotonic(), span)


@dataclass
class Migration:
    """One migration in progress: ends `admitted` (timed, counted, span closed) or `failed`."""

    policy: MigrationPolicy
    start: float
    span: object | None

    def admitted(self, instance: str) -> None:
        self._end("migrated", instance)

    def failed(self, why: str) -> None:
        self._end("failed", None, why)

    def _end(self, outcome: str, instance: str | None, why: str | None = None) -> None:
        seconds = time.monotonic() - self.start
        if self.policy.metrics is not None:
            self.policy.metrics.on_migration(outcome, seconds)
        span = self.span
        if span is not None:
            if instance is not None:
                span.set_attribute("kubesgl.to_instance", instance)  # type: ignore[attr-defined]
            if why is not None:
                span.set_attribute("kubesgl.error", why)  # type: ignore[attr-defined]
            span.end()  # type: ignore[attr-defined]


def resume_request(
    request: TokenizeRequest, attempt: int, output_ids: list[int], prompt_logprobs_sent: bool
) -> TokenizeRequest:
    """The choice's request again, resuming after `output_ids`: rid `<rid>~m<attempt>`; prompt logprobs
    already delivered are not asked for again (one that had not finished prefill restarts with them)."""
    sampling = request.sampling
    lp = sampling.logprobs
    if prompt_logprobs_sent and lp is not None and lp.prompt_start is not None:
        sampling = replace(sampling, logprobs=replace(lp, prompt_start=None))
    base = request.rid.split("~m", 1)[0]
    return replace(request, rid=f"{base}~m{attempt}", sampling=sampling, output_ids=list(output_ids))
