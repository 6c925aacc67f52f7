"""The wire protocol between kubesgl services: every NATS subject, header and message body.

Nothing outside this module builds a subject string. Bodies are msgpack maps of the dataclass fields plus a
`msg` tag naming the type; unknown fields are ignored so a newer sender can talk to an older receiver during
a rolling upgrade. Subjects carry the protocol version (`kubesgl.v1.`) so two versions can run side by side.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Self, TypeVar

import msgpack

from kubesgl.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidRequestError,
    KubesglError,
    ModelNotFoundError,
    ServiceUnavailableError,
    UnsupportedModelError,
)
from kubesgl.values.outputs import TokenLogprob
from kubesgl.values.sampling import SamplingParams

VERSION = "v1"
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


def gateway_subject(gateway_id: str) -> str:
    """Where the gateway holding a client's connection receives that client's TextDeltas."""
    return f"{_ROOT}.gw.{_token(gateway_id)}"


def _token(name: str) -> str:
    # One NATS subject token: a dot, space or wildcard would change which subscribers match.
    if not name or any(c in name for c in ". *>\t\r\n"):
        raise ValueError(f"invalid subject token {name!r}: must be non-empty without '.', '*', '>' or spaces")
    return name


class ProtocolError(ValueError):
    """A body that is not a valid message of the expected type."""


# What msgpack carries of a client's free-form JSON (chat_template_kwargs, tool definitions, ...). Checked where
# the value enters (the gateway's request models), so encoding a message can never fail on user data.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 32
MAX_JSON_STRING = 1 << 16


def json_value_error(value: Any, where: str) -> str | None:
    """Why `value` (parsed JSON) cannot travel on the wire, naming the offending path; None when it can."""
    return _json_error(value, where, where, 0)


def _json_error(value: Any, root: str, where: str, depth: int) -> str | None:
    if depth > MAX_JSON_DEPTH:
        return f"{root} is nested deeper than {MAX_JSON_DEPTH} levels"
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        return (
            None if WIRE_INT_MIN <= value <= WIRE_INT_MAX else f"{where} is outside the 64-bit integer range"
        )
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} is not a finite number"
    if isinstance(value, str):
        return (
            None if len(value) <= MAX_JSON_STRING else f"{where} is longer than {MAX_JSON_STRING} characters"
        )
    if isinstance(value, list):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                return f"{where} has a non-string key {k!r}"
            if len(k) > MAX_JSON_STRING:
                return f"{where} has a key longer than {MAX_JSON_STRING} characters"
        items = ((f"{where}[{k!r}]", v) for k, v in value.items())
    else:
        return f"{where} holds a {type(value).__name__}, which is not a JSON value"
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


M = TypeVar("M", bound="Message")


@dataclass
class Message:
    """Base of every wire message: msgpack encoding with a type tag; unknown fields ignored on decode."""

    def to_bytes(self) -> bytes:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body[_TYPE_KEY] = type(self).__name__
        return msgpack.packb(body, use_bin_type=True)

    @classmethod
    def from_bytes(cls, data: bytes) -> Self:
        body = _unpack(data)
        tag = body.get(_TYPE_KEY)
        if tag != cls.__name__:
            raise ProtocolError(f"expected a {cls.__name__} message, got {tag!r}")
        return cls._from_body(body)

    @classmethod
    def _from_body(cls, body: dict[str, Any]) -> Self:
        names = {f.name for f in dataclasses.fields(cls)}
        try:
            return cls(**{k: v for k, v in body.items() if k in names})
        except TypeError as e:
            raise ProtocolError(f"malformed {cls.__name__}: {e}") from e


def _unpack(data: bytes) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError(f"body is not msgpack: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"body is a {type(body).__name__}, expected a map")
    return body


def decode(data: bytes, *types: type[M]) -> M:
    """Decodes a body that may be any of `types` (e.g. a reply that is Admitted or ErrorReply)."""
    body = _unpack(data)
    tag = body.get(_TYPE_KEY)
    for t in types:
        if t.__name__ == tag:
            return t._from_body(body)
    raise ProtocolError(f"expected one of {[t.__name__ for t in types]}, got {tag!r}")


@dataclass
class TokenizeRequest(Message):
    """gateway -> any tokenizer: a prompt in one of three shapes ("chat", "completion" or "tokens")."""

    KINDS: ClassVar[tuple[str, ...]] = ("chat", "completion", "tokens")

    rid: str
    gateway_id: str
    model: str
    kind: str
    sampling: dict[str, Any]
    deadline: float
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    input_ids: list[int] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    session_id: str | None = None  # OpenAI `user` or header x-session-id: routers may keep a session together


@dataclass
class GenerateRequest(Message):
    """tokenizer -> one scheduler instance: token ids ready to run."""

    rid: str
    gateway_id: str
    input_ids: list[int]
    sampling: dict[str, Any]
    deadline: float


@dataclass
class Admitted(Message):
    """The scheduler accepted the request; the reply travels back through the tokenizer to the gateway."""

    rid: str
    instance_id: str
    prompt_tokens: int


@dataclass
class ErrorReply(Message):
    """A request refused at some stage; `status` is the HTTP status the gateway answers with."""

    rid: str
    status: int
    type: str
    message: str
    code: str | None = None
    param: str | None = None

    @classmethod
    def from_error(cls, rid: str, err: KubesglError) -> ErrorReply:
        return cls(rid=rid, **error_dict(err))

    def to_error(self) -> KubesglError:
        return error_from_dict(dataclasses.asdict(self))


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


@dataclass
class TokenDelta(Message):
    """One request's new tokens, after up to text.incremental.DETOK_CONTEXT_TOKENS of context: an entry of a TokenDeltaBatch.

    `tokens[new_from:]` are new; the context lets any replica decode without per-request state.
    `logprobs` has one wire_logprob entry per new token when requested. `traceparent` names the request's
    decode span (a batch's headers cannot carry one per request).
    """

    rid: str
    gateway_id: str
    instance_id: str
    seq: int
    tokens: list[int]
    new_from: int
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None
    error: dict[str, Any] | None = None
    traceparent: str | None = None


# msgpack framing of a TokenDeltaBatch around its entries: the map, its keys and the array header, and per
# entry a bin header; both bounded generously so a batch never exceeds the byte budget it was cut to.
_BATCH_FRAME_BYTES = 64
_ENTRY_FRAME_BYTES = 5


@dataclass
class TokenDeltaBatch(Message):
    """scheduler -> any detokenizer: the TokenDeltas of one engine step (one per request), in one message.

    Each entry is an encoded TokenDelta, decoded and answered on its own (BatchAck.refused), so one bad entry
    fails only its request, and the scheduler cuts batches to the NATS payload limit without encoding twice.
    """

    deltas: list[bytes]

    def __post_init__(self) -> None:
        if not isinstance(self.deltas, list) or not all(isinstance(d, bytes) for d in self.deltas):
            raise ProtocolError("TokenDeltaBatch.deltas must be a list of encoded TokenDeltas")

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

    def __post_init__(self) -> None:
        if not isinstance(self.refused, dict) or not all(isinstance(i, int) for i in self.refused):
            raise ProtocolError("BatchAck.refused must map entry indexes to reasons")


@dataclass
class TextDelta(Message):
    """detokenizer (or any stage reporting an error) -> the gateway holding the client."""

    rid: str
    instance_id: str
    seq: int
    text: str
    token_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[dict[str, Any]] | None = None
    error: dict[str, Any] | None = None


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


_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}


def sampling_to_dict(params: SamplingParams) -> dict[str, Any]:
    """SamplingParams as a wire dict (tuples become lists)."""
    out = dataclasses.asdict(params)
    out["stop_token_ids"] = list(params.stop_token_ids)
    return out


def sampling_from_dict(d: dict[str, Any]) -> SamplingParams:
    """Builds and validates SamplingParams; an unknown field is rejected rather than silently ignored."""
    unknown = sorted(set(d) - _SAMPLING_FIELDS)
    if unknown:
        raise InvalidRequestError(
            f"unsupported sampling parameter(s): {', '.join(unknown)}", param=unknown[0]
        )
    values = dict(d)
    if "stop_token_ids" in values:
        values["stop_token_ids"] = tuple(values["stop_token_ids"] or ())
    try:
        params = SamplingParams(**values)
    except TypeError as e:
        raise InvalidRequestError(f"invalid sampling parameters: {e}") from e
    params.validate()
    return params


def wire_logprob(lp: TokenLogprob) -> dict[str, Any]:
    """One generated token's logprob as the scheduler sends it (ids only; the detokenizer adds strings)."""
    return {"token_id": lp.token_id, "logprob": lp.logprob, "top": [[t, p] for t, p in lp.top]}


def error_dict(err: KubesglError) -> dict[str, Any]:
    """The error fields carried by ErrorReply and by TokenDelta/TextDelta.error."""
    return {
        "status": err.status,
        "type": err.type,
        "code": err.code,
        "param": err.param,
        "message": err.message,
    }


# Most specific first: the first class whose (status, code) matches rebuilds the error.
_ERROR_CLASSES: tuple[type[KubesglError], ...] = (
    ContextLengthError,
    ModelNotFoundError,
    UnsupportedModelError,
    InvalidRequestError,
    ServiceUnavailableError,
    DeadlineExceededError,
)


def error_from_dict(d: dict[str, Any]) -> KubesglError:
    """Rebuilds the typed error from its wire fields, keeping status/type/code even for unknown kinds."""
    status, code = int(d.get("status", 500)), d.get("code")
    message, param = str(d.get("message", "")), d.get("param")
    for cls in _ERROR_CLASSES:
        if cls.status == status and cls.code == code:
            return cls(message, param=param)
    err = KubesglError(message, param=param)
    err.status, err.type, err.code = status, str(d.get("type", "internal_error")), code
    return err
