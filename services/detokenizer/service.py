"""The detokenizer replica: turns each TokenDelta of a TokenDeltaBatch into a TextDelta for the gateway
holding that request's client, sent as one TextDeltaBatch per gateway per batch.

Stateless (kubesgl.text.incremental): any replica decodes any batch, so replicas can be killed or added
mid-stream. It publishes every entry's TextDelta before it acks the batch, so a replica killed in between
causes a scheduler retry of the whole batch (duplicates the gateway drops by seq), never a lost delta.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from kubesgl.errors import InvalidRequestError, KubesglError
from kubesgl.protocol import (
    DETOK,
    DETOKENIZER_QUEUE,
    HEADER_TRACEPARENT,
    BatchAck,
    ErrorInfo,
    ErrorReply,
    FinishReason,
    ProtocolError,
    TextDelta,
    TextDeltaBatch,
    TokenDelta,
    TokenDeltaBatch,
    TokenLogprob,
    gateway_subject,
)
from kubesgl.runtime.nats_conn import close
from kubesgl.runtime.telemetry.metrics import DetokenizerMetrics
from kubesgl.runtime.telemetry.tracing import ATTR_RID, ATTR_SEQ, SPAN_DETOKENIZE, Tracing
from kubesgl.text.tokenizer import ModelTokenizer
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

log = logging.getLogger("kubesgl.detokenizer")


class DetokenizerService:
    exit_code = 0

    def __init__(
        self, nc: Client, tokenizer: ModelTokenizer, metrics: DetokenizerMetrics, tracing: Tracing
    ) -> None:
        self.nc = nc
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.tracing = tracing
        self._sub: Subscription | None = None

    async def start(self) -> None:
        self.tokenizer.prepare_delta_text()  # its byte table (~0.25 s), before the first delta rather than on it
        # Handled in arrival order on one subscription: decoding is microseconds and publish only buffers.
        self._sub = await self.nc.subscribe(DETOK, queue=DETOKENIZER_QUEUE, cb=self._on_batch)

    def nats_reconnected(self) -> None:
        self.metrics.nats.on_reconnect()

    def ready(self) -> bool:
        return self.nc.is_connected and self._sub is not None

    async def drain(self, timeout_s: float) -> None:
        await close(self.nc)  # finishes the deltas already received, then closes

    async def _on_batch(self, msg: Msg) -> None:
        with self.metrics.requests.track() as status:
            try:
                batch = TokenDeltaBatch.from_bytes(msg.data)
            except ProtocolError as e:
                log.error("malformed TokenDeltaBatch: %s", e)
                status.status = 400
                err = ErrorReply.from_error("", InvalidRequestError(str(e)))
                await msg.respond(err.to_bytes())
                return
            refused: dict[int, str] = {}
            by_gateway: dict[str, list[TextDelta]] = {}
            decoded = 0
            for i, entry in enumerate(batch.deltas):
                try:
                    delta = TokenDelta.from_bytes(entry)
                    subject = gateway_subject(delta.gateway_id)
                except ValueError as e:  # ProtocolError, or a gateway id that is no subject token
                    log.error("malformed TokenDelta %d of a batch of %d: %s", i, len(batch.deltas), e)
                    refused[i] = str(e)
                    continue
                by_gateway.setdefault(subject, []).append(self._decode(delta))
                decoded += len(delta.tokens) - delta.new_from
            self.metrics.on_decoded(decoded)  # once per batch: a counter's lock per delta cost ~0.3 µs each
            for subject, texts in by_gateway.items():
                await self._publish(subject, texts)
            if refused:
                status.status = 400
            if msg.reply:
                await msg.respond(BatchAck(refused=refused).to_bytes())

    def _decode(self, delta: TokenDelta) -> TextDelta:
        # A sampled request's first delta (its time to first token) and its last get a span, joining the trace
        # (never starting one). A span per delta was hundreds per trace, and their export cost the detokenizer
        # more CPU than its decoding (a third of its samples with every 8th request sampled).
        if (delta.seq == 0 or delta.finished) and self.tracing.records_under(delta.traceparent):
            parent = {HEADER_TRACEPARENT: delta.traceparent or ""}
            with self.tracing.span(SPAN_DETOKENIZE, parent, {ATTR_RID: delta.rid, ATTR_SEQ: delta.seq}):
                text = self.text_delta(delta)
        else:
            text = self.text_delta(delta)
        return text

    async def _publish(self, subject: str, texts: list[TextDelta]) -> None:
        """One TextDeltaBatch for the gateway; its entries one by one should it pass the NATS payload limit.
        No NATS headers: the gateway reads only the body (nats-py's header parser cost it ~20 us a message)."""
        body = TextDeltaBatch(deltas=texts).to_bytes()
        if len(body) <= self.nc.max_payload:
            await self.nc.publish(subject, body)
            return
        for text in texts:
            await self.nc.publish(subject, text.to_bytes())

    def text_delta(self, delta: TokenDelta) -> TextDelta:
        """The TextDelta for one TokenDelta; a delta that cannot be decoded ends its stream with an error."""
        new_ids = delta.tokens[delta.new_from :]
        error = delta.error
        try:
            text = self.tokenizer.delta_text(delta.tokens, delta.new_from, delta.finished)
            logprobs = [self._logprob(lp) for lp in delta.logprobs] if delta.logprobs is not None else None
            prompt_logprobs, prompt_text = None, None
            if delta.prompt_logprobs is not None:
                prompt_logprobs = [self._logprob(lp) for lp in delta.prompt_logprobs]
                prompt_text = self.tokenizer.decode([lp.token_id for lp in delta.prompt_logprobs])
        except Exception as e:  # a token id the tokenizer cannot decode must not crash the replica
            log.error("cannot decode delta %s of %s: %s", delta.seq, delta.rid, e)
            text, logprobs, prompt_logprobs, prompt_text = "", None, None, None
            error = ErrorInfo.of(KubesglError(f"detokenization failed: {e}"))
        return TextDelta(
            rid=delta.rid,
            instance_id=delta.instance_id,
            seq=delta.seq,
            text=text,
            token_ids=new_ids,
            finished=delta.finished or error is not None,
            finish_reason=delta.finish_reason
            if error is None
            else (delta.finish_reason or FinishReason.ABORT),
            prompt_tokens=delta.prompt_tokens,
            cached_tokens=delta.cached_tokens,
            completion_tokens=delta.completion_tokens,
            logprobs=logprobs,
            error=error,
            prompt_logprobs=prompt_logprobs,
            prompt_text=prompt_text,
        )

    def _logprob(self, lp: TokenLogprob) -> TokenLogprob:
        """The engine's logprob with the text and bytes of its token and alternatives."""
        tok = self.tokenizer
        return replace(
            lp,
            token=tok.token_text(lp.token_id),
            token_bytes=tok.token_bytes(lp.token_id),
            top_tokens=tuple(tok.token_text(t) for t, _ in lp.top),
            top_bytes=tuple(tok.token_bytes(t) for t, _ in lp.top),
        )
