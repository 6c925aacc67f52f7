"""The wire protocol between kubesgl services: every NATS subject, header and message body.

A module per concern, each name re-exported here (`from kubesgl.protocol import Admitted`, `protocol.DETOK`):
`subjects` (every subject, queue group and header: nothing outside it builds a subject string), `message` (how a
body is encoded and decoded), `json_values` (what of a client's JSON may travel), and the messages by route:
`requests` (admission, its replies, aborts), `disagg` (decode and prefill instances), `control` (heartbeats,
prefix-cache events, stats) and `deltas` (the per-step token and text stream). The values from below the wire
that callers have taken from here (ProtocolError, FinishReason, TokenLogprob, SamplingParams) are here too.
"""

from __future__ import annotations

from kubesgl.codec import ProtocolError
from kubesgl.protocol.control import (
    HEARTBEAT_INTERVAL_S,
    HEARTBEAT_MISSES_TO_EXPIRE,
    Heartbeat,
    KvEvents,
    KvSnapshot,
    SchedulerStats,
)
from kubesgl.protocol.deltas import (
    BatchAck,
    TextDelta,
    TextDeltaBatch,
    TokenDelta,
    TokenDeltaBatch,
    gateway_deltas,
)
from kubesgl.protocol.disagg import KvRelease, PrefillAsk, PrefillDone
from kubesgl.protocol.json_values import (
    MAX_JSON_DEPTH,
    MAX_JSON_STRING,
    WIRE_INT_MAX,
    WIRE_INT_MIN,
    JsonValueError,
    json_value_error,
)
from kubesgl.protocol.message import Message, StructMessage, decode
from kubesgl.protocol.requests import (
    Abort,
    Admitted,
    ChatMessage,
    ChatToolCall,
    ErrorInfo,
    ErrorReply,
    GenerateRequest,
    PromptKind,
    TokenizeRequest,
)
from kubesgl.protocol.subjects import (
    ABORT,
    DETOK,
    DETOKENIZER_QUEUE,
    HEADER_DEADLINE,
    HEADER_RID,
    HEADER_TRACEPARENT,
    HEARTBEAT,
    KV_EVENTS_ALL,
    TOKENIZE,
    TOKENIZER_QUEUE,
    VERSION,
    check_ids,
    gateway_subject,
    generate_subject,
    handoff_subject,
    header_deadline,
    header_traceparent,
    headers,
    kv_events_subject,
    kv_snapshot_subject,
    prefill_subject,
    stats_subject,
)
from kubesgl.values.outputs import FinishReason, TokenLogprob
from kubesgl.values.sampling import SamplingParams

__all__ = [
    "ABORT",
    "Abort",
    "Admitted",
    "BatchAck",
    "ChatMessage",
    "ChatToolCall",
    "DETOK",
    "DETOKENIZER_QUEUE",
    "ErrorInfo",
    "ErrorReply",
    "FinishReason",
    "GenerateRequest",
    "HEADER_DEADLINE",
    "HEADER_RID",
    "HEADER_TRACEPARENT",
    "HEARTBEAT",
    "HEARTBEAT_INTERVAL_S",
    "HEARTBEAT_MISSES_TO_EXPIRE",
    "Heartbeat",
    "JsonValueError",
    "KV_EVENTS_ALL",
    "KvEvents",
    "KvRelease",
    "KvSnapshot",
    "MAX_JSON_DEPTH",
    "MAX_JSON_STRING",
    "Message",
    "PrefillAsk",
    "PrefillDone",
    "PromptKind",
    "ProtocolError",
    "SamplingParams",
    "SchedulerStats",
    "StructMessage",
    "TOKENIZE",
    "TOKENIZER_QUEUE",
    "TextDelta",
    "TextDeltaBatch",
    "TokenDelta",
    "TokenDeltaBatch",
    "TokenLogprob",
    "TokenizeRequest",
    "VERSION",
    "WIRE_INT_MAX",
    "WIRE_INT_MIN",
    "check_ids",
    "decode",
    "gateway_deltas",
    "gateway_subject",
    "generate_subject",
    "handoff_subject",
    "header_deadline",
    "header_traceparent",
    "headers",
    "json_value_error",
    "kv_events_subject",
    "kv_snapshot_subject",
    "prefill_subject",
    "stats_subject",
]
