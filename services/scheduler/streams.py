"""Per-request output bookkeeping on the scheduler: what the engine produced, what went out, the next delta.

Each TokenDelta carries the tokens since the last delta behind up to DETOK_CONTEXT_TOKENS already-sent ones
(kubesgl.text.incremental.delta_window), so any detokenizer replica can decode it. One delta per request is
in flight at a time; tokens that arrive meanwhile ride in the next one. With a stream interval of k, a delta
after the first waits until k tokens are new, unless the request finished.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kubesgl.errors import KubesglError
from kubesgl.protocol import ErrorInfo, TextDelta, TokenDelta
from kubesgl.text.incremental import delta_window
from kubesgl.values.outputs import FinishReason, RequestOutput, TokenLogprob


@dataclass(slots=True)
class RequestStream:
    rid: str
    gateway_id: str
    deadline: float
    prompt_tokens: int
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    wants_logprobs: bool = False
    interval: int = 1  # after the first delta, one only once this many tokens are new (or the last is there)
    prompt_logprobs: list[TokenLogprob] | None = None  # until the first delta carries them
    cached_tokens: int = 0
    finished: bool = False
    finish_reason: FinishReason | None = None
    traceparent: str | None = None
    sent: int = 0  # output tokens already put into a delta
    resumed: int = 0  # output tokens that existed at admission (a resume): `logprobs` starts after them
    seq: int = 0  # seq of the next delta
    final_sent: bool = False
    abandoned: bool = False  # aborted, failed or timed out: nothing more goes to the gateway

    @property
    def done(self) -> bool:
        return self.final_sent or self.abandoned

    def add(self, out: RequestOutput, traceparent: str | None) -> None:
        self.output_ids += out.new_token_ids
        if self.wants_logprobs and out.logprobs:
            self.logprobs += out.logprobs
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.cached_tokens = out.cached_tokens
        self.traceparent = traceparent or self.traceparent
        if out.finished:
            self.finished, self.finish_reason = True, out.finish_reason

    def next_delta(self, instance_id: str) -> TokenDelta | None:
        """The next delta to send, or None when everything produced so far went out."""
        if self.abandoned or self.final_sent:
            return None
        new = len(self.output_ids) - self.sent
        if not self.finished and (new == 0 or (self.seq > 0 and new < self.interval)):
            return None
        tokens, new_from = delta_window(self.output_ids, self.sent)
        delta = TokenDelta(
            rid=self.rid,
            gateway_id=self.gateway_id,
            instance_id=instance_id,
            seq=self.seq,
            tokens=tokens,
            new_from=new_from,
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=len(self.output_ids),
            logprobs=self.logprobs[self.sent - self.resumed :] if self.wants_logprobs else None,
            traceparent=self.traceparent,
            prompt_logprobs=self.prompt_logprobs,
        )
        self.sent, self.seq, self.final_sent = len(self.output_ids), self.seq + 1, self.finished
        self.prompt_logprobs = None
        return delta

    def abandon(self, instance_id: str, err: KubesglError) -> TextDelta:
        """Ends the stream here; the returned error delta goes straight to the gateway."""
        self.abandoned = True
        delta = TextDelta(
            rid=self.rid,
            instance_id=instance_id,
            seq=self.seq,
            text="",
            finished=True,
            finish_reason=FinishReason.ABORT,
            prompt_tokens=self.prompt_tokens,
            cached_tokens=self.cached_tokens,
            completion_tokens=self.sent,
            error=ErrorInfo.of(err),
        )
        self.seq += 1
        return delta
