"""The wire protocol between kubesgl services: every NATS subject, header and message body.

Nothing outside this module builds a subject string. A body is a msgpack map of a message's fields plus a `msg`
tag naming its type: dataclasses through kubesgl.codec, and the per-step deltas as msgspec Structs (StructMessage),
the same map decoded in C. Fields are typed: nested dataclasses (SamplingParams,
TokenLogprob, ErrorInfo, ...), enums (PromptKind, FinishReason), tuples; each is checked against its declared
type on decode, so a malformed value is refused where it arrives. Unknown message fields are ignored, so a newer
sender can add one; unknown sampling fields are refused (an option the receiver would drop is one it cannot
honour). Subjects carry the protocol version (`kubesgl.v2.`); v1 and v2 services never cross-talk
(docs/architecture.md says how to upgrade across it).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, NamedTuple, Self, TypeVar

import msgspec

from kubesgl.codec import (
    JsonValue,
    ProtocolError,
    UnknownFieldsError,
    decode_value,
    encode_value,
    pack,
    refuse_unknown_fields,
    unpack,
)
from kubesgl.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidRequestError,
    KubesglError,
    ModelNotFoundError,
    ServiceUnavailableError,
    UnsupportedModelError,
    param_path,
)
from kubesgl.values.constraint import Constraint
from kubesgl.values.outputs import FinishReason, TokenLogprob
from kubesgl.values.sampling import LogprobOptions, SamplingParams

VERSION = "v2"
_ROOT = f"kubesgl.{VERSION}"

TOKENIZE = f"{_ROOT}.tokenize"
ABORT = f"{_ROOT}.abort"
HEARTBEAT = f"{_ROOT}.sched.heartbeat"
# TokenDeltaBatch; the subject changed with the body (was `detok`, one TokenDelta), so during a rolling upgrade
# old and new schedulers each reach only detokenizers that understand them.
DETOK = f"{_ROOT}.detok.batch"
KV_EVENTS_ALL = f"{_ROOT}.kv.*"  # every instance's KvEvents (routers subscribe to all of them)

TOKENIZER_QUEUE = "tokenizer"
DETOKENIZER_QUEUE = "detokenizer"

HEADER_RID = "kubesgl-rid"
HEADER_DEADLINE = "kubesgl-deadline"
HEADER_TRACEPARENT = "traceparent"

HEARTBEAT_INTERVAL_S = 1.0
# A scheduler missing this many heartbeats in a row is considered gone.
HEARTBEAT_MISSES_TO_EXPIRE = 3

_TYPE_KEY = "msg"


def generate_subject(instance_id: str) -> str:
    """Where one scheduler instance's rank 0 takes GenerateRequests."""
    return f"{_ROOT}.sched.{_token(instance_id)}.generate"


def stats_subject(instance_id: str) -> str:
    """Request/reply subject answering one scheduler instance's SchedulerStats (operators and tests)."""
    return f"{_ROOT}.sched.{_token(instance_id)}.stats"


def kv_events_subject(instance_id: str) -> str:
    """Where one scheduler instance broadcasts its prefix-cache KvEvents (matched by KV_EVENTS_ALL)."""
    return f"{_ROOT}.kv.{_token(instance_id)}"


def kv_snapshot_subject(instance_id: str) -> str:
    """Request/reply subject answering a KvSnapshot of everything one instance's prefix cache holds now."""
    return f"{_ROOT}.sched.{_token(instance_id)}.kv_snapshot"


def prefill_subject(instance_id: str) -> str:
    """Where a prefill-role instance takes PrefillAsks, and KvReleases of handoffs it holds."""
    return f"{_ROOT}.sched.{_token(instance_id)}.prefill"


def handoff_subject(instance_id: str) -> str:
    """Where a decode-role instance takes the PrefillDones of prompts computed for it."""
    return f"{_ROOT}.sched.{_token(instance_id)}.handoff"


def gateway_subject(gateway_id: str) -> str:
    """Where the gateway holding a client's connection receives that client's TextDeltas."""
    return f"{_ROOT}.gw.{_token(gateway_id)}"


def _token(name: str) -> str:
    # One NATS subject token: a dot, space or wildcard would change which subscribers match.
    if not name or any(c in name for c in ". *>\t\r\n"):
        raise ValueError(f"invalid subject token {name!r}: must be non-empty without '.', '*', '>' or spaces")
    return name


# What msgpack carries of a client's free-form JSON (chat_template_kwargs, tool definitions, ...). Checked where
# the value enters (the gateway's request models), so encoding a message can never fail on user data.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 32
MAX_JSON_STRING = 1 << 16


class JsonValueError(NamedTuple):
    """Why a JSON value cannot travel on the wire: `path` (errors.param_path's syntax) and what is wrong there."""

    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path} {self.why}" if self.path else self.why


def json_value_error(value: Any, where: str) -> JsonValueError | None:
    """Why `value` (parsed JSON) cannot travel on the wire, naming the offending path below `where`; None when
    it can."""
    return _json_error(value, where, where, 0)


def _json_error(value: Any, root: str, where: str, depth: int) -> JsonValueError | None:
    if depth > MAX_JSON_DEPTH:
        return JsonValueError(root, f"is nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        ok = WIRE_INT_MIN <= value <= WIRE_INT_MAX
        return None if ok else JsonValueError(where, "is outside the 64-bit integer range")
    if isinstance(value, float):
        return None if math.isfinite(value) else JsonValueError(where, "is not a finite number")
    if isinstance(value, str):
        ok = len(value) <= MAX_JSON_STRING
        return None if ok else JsonValueError(where, f"is longer than {MAX_JSON_STRING} characters")
    if isinstance(value, list):
        items = ((param_path(where, i), v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                return JsonValueError(where, f"has a non-string key {k!r}")
            if len(k) > MAX_JSON_STRING:
                return JsonValueError(where, f"has a key longer than {MAX_JSON_STRING} characters")
        items = ((param_path(where, k), v) for k, v in value.items())
    else:
        return JsonValueError(where, f"holds a {type(value).__name__}, which is not a JSON value")
    return next((e for path, v in items if (e := _json_error(v, root, path, depth + 1))), None)


_MAX_ID_LEN = 256


def check_ids(rid: str, gateway_id: str) -> None:
    """Refuses ids that would break a header or a subject (they travel in both) before anyone relies on them."""
    if not isinstance(rid, str) or not rid or len(rid) > _MAX_ID_LEN or not rid.isprintable() or " " in rid:
        raise InvalidRequestError(
            f"invalid request id {rid!r}: 1-{_MAX_ID_LEN} printable characters, no spaces"
        )
    try:
        gateway_subject(gateway_id)
    except (ValueError, TypeError) as e:
        raise InvalidRequestError(f"invalid gateway id: {e}") from None


def headers(rid: str, deadline: float | None = None, traceparent: str | None = None) -> dict[str, str]:
    """The NATS headers every kubesgl message carries."""
    out = {HEADER_RID: rid}
    if deadline is not None:
        out[HEADER_DEADLINE] = repr(float(deadline))
    if traceparent:
        out[HEADER_TRACEPARENT] = traceparent
    return out


def header_deadline(hdrs: dict[str, str] | None) -> float | None:
    """The absolute deadline (unix seconds) from message headers, None when absent or malformed."""
    raw = (hdrs or {}).get(HEADER_DEADLINE)
    try:
        return float(raw) if raw is not None else None
    except ValueError:
        return None


def header_traceparent(hdrs: Mapping[str, str] | None) -> str | None:
    """The W3C `traceparent` in message headers; None when absent (tracing off, or a sender from before the
    message carried one: its receiver makes no span, as for any unsampled request)."""
    return (hdrs or {}).get(HEADER_TRACEPARENT) or None


M = TypeVar("M", bound="Message")

# Every field of these changes what the engine does: one a receiver does not know is refused, not dropped.
refuse_unknown_fields(SamplingParams, LogprobOptions, Constraint)


@dataclass
class Message:
    """Base of every wire message: msgpack encoding with a type tag; unknown fields ignored on decode."""

    def to_bytes(self) -> bytes:
        body = encode_value(self)
        body[_TYPE_KEY] = type(self).__name__
        return pack(body)

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        body = unpack(data)
        tag = body.get(_TYPE_KEY)
        if tag != cls.__name__:
            raise ProtocolError(f"expected a {cls.__name__} message, got {tag!r}")
        return cls._from_body(body)

    @classmethod
    def _from_body(cls, body: dict[str, Any]) -> Self:
        try:
            return decode_value(cls, body)
        except UnknownFieldsError as e:  # only SamplingParams and its parts refuse them
            raise InvalidRequestError(
                f"unsupported sampling parameter(s): {', '.join(e.unknown)}", param=e.unknown[0]
            ) from None


def decode(data: bytes, *types: type[M]) -> M:
    """Decodes a body that may be any of `types` (e.g. a reply that is Admitted or ErrorReply)."""
    body = unpack(data)
    tag = body.get(_TYPE_KEY)
    for t in types:
        if t.__name__ == tag:
            return t._from_body(body)
    raise ProtocolError(f"expected one of {[t.__name__ for t in types]}, got {tag!r}")


class StructMessage(msgspec.Struct, tag_field=_TYPE_KEY, tag=True):
    """Base of the messages every engine step sends (token and text deltas: ~50 k/s at GPU pace): msgspec Structs,
    encoded, decoded and type-checked in C, 10-26x faster than the dataclass codec (docs/performance.md, the
    split's CPU cost). On the wire the same map as a Message: the fields plus the `msg` tag (required), unknown fields
    ignored. Only a body that fails is looked at again, so its refusal reads as a Message's does."""

    def to_bytes(self) -> bytes:
        return _STRUCT_ENCODER.encode(self)

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        decoder = _STRUCT_DECODERS.get(cls)
        if decoder is None:
            decoder = _STRUCT_DECODERS[cls] = msgspec.msgpack.Decoder(cls | _OtherTag)
        try:
            msg = decoder.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            raise _refusal((cls,), data, e) from None
        if not isinstance(msg, cls):
            raise ProtocolError(f"expected a {cls.__name__} message, got {type(msg).__name__!r}")
        return msg


class _OtherTag(StructMessage):
    """Never sent: a decoder for the union of one class and this one requires the `msg` tag (one class alone
    would take a map without it)."""


_STRUCT_ENCODER = msgspec.msgpack.Encoder()
_STRUCT_DECODERS: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def _refusal(classes: tuple[type, ...], data: bytes, err: Exception) -> ProtocolError:
    """Why a body msgspec refused is no message of `classes`, worded as for a Message."""
    tag = unpack(data).get(_TYPE_KEY)  # raises "body is not msgpack" / "expected a map" as for a Message
    names = [c.__name__ for c in classes]
    if tag not in names:
        expected = f"a {names[0]} message" if len(names) == 1 else f"one of {names}"
        return ProtocolError(f"expected {expected}, got {tag!r}")
    return ProtocolError(f"malformed {tag}: {err}")


class PromptKind(StrEnum):
    CHAT = "chat"  # `messages`, rendered by the model's chat template
    COMPLETION = "completion"  # `prompt`, a text to encode
    TOKENS = "tokens"  # `input_ids`, token ids taken as given


@dataclass(frozen=True)
class ChatToolCall:
    """A call an assistant turn made, as chat templates take it: `arguments` an object, not OpenAI's string."""

    name: str
    arguments: dict[str, JsonValue]
    id: str | None = None


@dataclass(frozen=True)
class ChatMessage:
    """One message of a chat, normalized by the gateway (`chat_history.template_messages`) for the template."""

    role: str  # system | user | assistant | tool (the gateway maps OpenAI's "developer" to system)
    content: str
    name: str | None = None
    tool_calls: tuple[ChatToolCall, ...] = ()  # assistant turns that called tools
    tool_call_id: str | None = None  # tool turns: the call this result answers


@dataclass(frozen=True)
class ErrorInfo:
    """Why a request failed, as it travels: the HTTP status the gateway answers with and OpenAI's error fields
    (type and code follow errors.py, so the gateway rebuilds the same error)."""

    status: int
    type: str
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def of(cls, err: KubesglError) -> ErrorInfo:
        return cls(err.status, err.type, err.message, err.code, err.param)

    def to_error(self) -> KubesglError:
        """The typed error these fields came from, keeping status/type/code even for an unknown kind."""
        for kind in _ERROR_CLASSES:
            if kind.status == self.status and kind.code == self.code:
                return kind(self.message, param=self.param)
        err = KubesglError(self.message, param=self.param)
        err.status, err.type, err.code = self.status, self.type, self.code
        return err


# Most specific first: the first class whose (status, code) matches rebuilds the error.
_ERROR_CLASSES: tuple[type[KubesglError], ...] = (
    ContextLengthError,
    ModelNotFoundError,
    UnsupportedModelError,
    InvalidRequestError,
    ServiceUnavailableError,
    DeadlineExceededError,
)


@dataclass
class TokenizeRequest(Message):
    """gateway -> any tokenizer: one prompt (of `kind`) and how to sample its completion.

    `sampling` is checked at the gateway and again by the engine, nowhere between; its max_tokens None means
    "until the context ends" (or the server's default), which the engine resolves."""

    rid: str
    gateway_id: str
    model: str
    kind: PromptKind
    sampling: SamplingParams
    deadline: float
    messages: tuple[ChatMessage, ...] = ()  # kind chat
    prompt: str | None = None  # kind completion
    input_ids: list[int] | None = None  # kind tokens
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, JsonValue] | None = None
    session_id: str | None = None  # OpenAI `user` or header x-session-id: routers may keep a session together
    # kind chat: OpenAI function tools (checked by the gateway), rendered by the template unless tool_choice
    # is "none"; tool_choice "required" or {"type": "function", ...} is enforced by the tokenizer's grammar.
    tools: tuple[JsonValue, ...] = ()
    tool_choice: JsonValue = None
    parallel_tool_calls: bool = True
    # A resumed request (a migration: its scheduler died mid-stream): the output tokens the gateway already
    # streamed. The prompt is made as the first time; the tokenizer passes these on (GenerateRequest.output_ids).
    output_ids: list[int] = field(default_factory=list)


@dataclass
class GenerateRequest(Message):
    """tokenizer -> one scheduler instance: token ids ready to run.

    `output_ids` non-empty makes it a resume admission: the request's first len(output_ids) output tokens
    already exist (streamed by an instance that died, or produced by a prefill instance). The scheduler prefills
    input_ids + output_ids and continues at that output position (Engine.add_request): max_tokens counts them,
    they are not sent again, and usage counts them once."""

    rid: str
    gateway_id: str
    input_ids: list[int]
    sampling: SamplingParams
    deadline: float
    output_ids: list[int] = field(default_factory=list)
    # Disaggregation: the prefill instance the router chose for this request's prompt ("" for none: the
    # receiving instance prefills it itself).
    prefill_instance: str = ""


@dataclass
class PrefillAsk(Message):
    """decode instance -> prefill instance: compute this prompt and its first token, hand the KV back."""

    rid: str
    decode_instance: str
    input_ids: list[int]
    sampling: SamplingParams
    deadline: float


@dataclass
class PrefillDone(Message):
    """prefill instance -> decode instance: the first token(s), and NIXL's descriptors of the prompt's full KV
    pages (engine/scheduler/disagg.py). `finished`: the request ended at its first token; nothing to pull."""

    rid: str
    seed: int
    new_token_ids: list[int]
    cached_tokens: int
    num_pages: int
    agent_metadata: bytes
    descs: bytes
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None


@dataclass
class KvRelease(Message):
    """decode instance -> prefill instance: done with the handoff's pages (pulled, or given up)."""

    rid: str


@dataclass
class Admitted(Message):
    """The scheduler accepted the request; the reply travels back through the tokenizer to the gateway."""

    rid: str
    instance_id: str
    prompt_tokens: int
    # Set by the tokenizer when the output is to be parsed for tool calls: the `tool_calls` format's name.
    tool_format: str | None = None


@dataclass
class ErrorReply(Message):
    """A request refused at some stage (the reply to TokenizeRequest or GenerateRequest instead of Admitted)."""

    rid: str
    error: ErrorInfo

    @classmethod
    def from_error(cls, rid: str, err: KubesglError) -> ErrorReply:
        return cls(rid, ErrorInfo.of(err))

    def to_error(self) -> KubesglError:
        return self.error.to_error()


@dataclass
class Abort(Message):
    """gateway -> all schedulers: stop this request and free its pages (instance_id None = whoever has it)."""

    rid: str
    instance_id: str | None = None


@dataclass
class Heartbeat(Message):
    """A scheduler instance announcing itself and its load; its absence for a few intervals means it is gone."""

    instance_id: str
    model: str
    context_len: int
    page_size: int
    num_pages: int
    running: int
    queued: int
    free_pages: int
    available_pages: int
    max_running_requests: int
    draining: bool
    ts: float
    # Prefix-cache KV events: block size in tokens (0 = not published), this process's epoch, last seq sent.
    kv_block_size: int = 0
    kv_epoch: str = ""
    kv_seq: int = 0
    role: str = "both"  # --disaggregation-mode: prefill | decode | both (engine/scheduler/disagg.py)


@dataclass
class KvEvents(Message):
    """scheduler -> routers: prefix blocks its cache stored and removed since the previous batch.

    `seq` counts batches from 1 within one `epoch` (a process start), so a router sees a lost batch as a gap;
    `stored` and `removed` are disjoint (kubesgl.kv.kv_events block hashes of `block_size` tokens).
    """

    instance_id: str
    epoch: str
    seq: int
    block_size: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


@dataclass
class KvSnapshot(Message):
    """Reply on kv_snapshot_subject: every block the instance's cache holds, as of batch `seq` of `epoch`."""

    instance_id: str
    epoch: str
    seq: int
    block_size: int
    blocks: list[int] = field(default_factory=list)


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
        out: list[tuple[list[TokenDelta], bytes]] = []
        group: list[TokenDelta] = []
        entries: list[bytes] = []
        size = _BATCH_FRAME_BYTES
        for delta in deltas:
            entry = delta.to_bytes()
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


@dataclass
class SchedulerStats(Message):
    """Reply on stats_subject: the engine's counters, for operators and tests (e.g. pages back after abort)."""

    instance_id: str
    running: int
    queued: int
    free_pages: int
    available_pages: int
    total_pages: int
    cached_prefix_pages: int
    active_rids: list[str] = field(default_factory=list)
    draining: bool = False
