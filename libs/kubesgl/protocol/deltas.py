"""The per-step output stream: scheduler -> any detokenizer (a TokenDeltaBatch of TokenDeltas, answered by a
BatchAck), detokenizer -> the gateway holding the client (a TextDeltaBatch of TextDeltas)."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from kubesgl.protocol.message import Message, StructMessage, _refusal
from kubesgl.protocol.requests import ErrorInfo
from kubesgl.values.outputs import FinishReason, TokenLogprob


class TokenDelta(StructMessage):
    """One request's new tokens, an entry of a TokenDeltaBatch.

    `tokens[new_from:]` are new; the ones before, up to text.incremental.DETOK_CONTEXT_TOKENS already sent, are
    context that lets any replica decode without per-request state.
    `logprobs` has one TokenLogprob (ids only) per new token when requested; `prompt_logprobs` (first delta
    only) the prompt tokens' from LogprobOptions.prompt_start on. `traceparent` names the request's decode span
    (a batch's headers cannot carry one per request).
    """

    rid: str
    gateway_id: str
    instance_id: str
    seq: int
    tokens: list[int]
    new_from: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: ErrorInfo | None = None
    traceparent: str | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


# msgpack framing of a TokenDeltaBatch around its entries: the map, its keys and the array header, and per
# entry a bin header; both bounded generously so a batch never exceeds the byte budget it was cut to.
_BATCH_FRAME_BYTES = 64
_ENTRY_FRAME_BYTES = 5


class TokenDeltaBatch(StructMessage):
    """scheduler -> any detokenizer: the TokenDeltas of one engine step (one per request), in one message.

    Each entry is an encoded TokenDelta, decoded and answered on its own (BatchAck.refused), so one bad entry
    fails only its request, and the scheduler cuts batches to the NATS payload limit without encoding twice.
    """

    deltas: list[bytes]

    @classmethod
    def pack(cls, deltas: list[TokenDelta], max_bytes: int) -> list[tuple[list[TokenDelta], bytes]]:
        """Encodes `deltas` into as few batches of at most `max_bytes` as they fit in, in order; a delta too
        big for any batch goes alone. Returns each batch's body with the deltas it carries."""
        encoded = [delta.to_bytes() for delta in deltas]
        if not encoded:
            return []
        if _BATCH_FRAME_BYTES + sum(map(len, encoded)) + _ENTRY_FRAME_BYTES * len(encoded) <= max_bytes:
            return [(deltas, cls(encoded).to_bytes())]  # all in one: the usual case
        out: list[tuple[list[TokenDelta], bytes]] = []
        group: list[TokenDelta] = []
        entries: list[bytes] = []
        size = _BATCH_FRAME_BYTES
        for delta, entry in zip(deltas, encoded, strict=True):
            if entries and size + len(entry) + _ENTRY_FRAME_BYTES > max_bytes:
                out.append((group, cls(entries).to_bytes()))
                group, entries, size = [], [], _BATCH_FRAME_BYTES
            group.append(delta)
            entries.append(entry)
            size += len(entry) + _ENTRY_FRAME_BYTES
        if entries:
            out.append((group, cls(entries).to_bytes()))
        return out


@dataclass
class BatchAck(Message):
    """detokenizer -> scheduler: the TextDelta of every entry of a TokenDeltaBatch has been published,
    except the `refused` ones (entry index -> why: not a valid TokenDelta)."""

    refused: dict[int, str] = field(default_factory=dict)


class TextDelta(StructMessage):
    """detokenizer (or any stage reporting an error) -> the gateway holding the client; `logprobs` and
    `prompt_logprobs` are the TokenDelta's with their text filled in, `prompt_text` the decoded text of the
    prompt tokens those cover (what echo returns for a prompt given as token ids)."""

    rid: str
    instance_id: str
    seq: int
    text: str
    token_ids: list[int] = []
    finished: bool = False
    finish_reason: FinishReason | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    error: ErrorInfo | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None


class TextDeltaBatch(StructMessage):
    """detokenizer -> one gateway: the TextDeltas of one TokenDeltaBatch whose requests that gateway holds, in
    one message: a NATS message per gateway per batch, not one per request per token (each cost the gateway
    a message dispatch; see docs/performance.md, serve path)."""

    deltas: list[TextDelta]


def gateway_deltas(data: bytes) -> list[TextDelta]:
    """What a gateway's subject carries: a TextDeltaBatch, or one TextDelta (a stage reporting an error)."""
    try:
        msg = _GATEWAY_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise _refusal((TextDeltaBatch, TextDelta), data, e) from None
    return msg.deltas if isinstance(msg, TextDeltaBatch) else [msg]


_GATEWAY_DECODER = msgspec.msgpack.Decoder(TextDeltaBatch | TextDelta)
