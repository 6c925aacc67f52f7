"""The encoders' pre-encoded frames (Encoder.frames) against the chunks they stand for, encoded one by one by
`sse`: the same bytes for every text, every choice index, with and without include_usage, and the events that
are not plain text (logprobs, a finish, tool calls, an empty text) taking the chunk path."""

from __future__ import annotations

import functools

import pytest
from kubesgl.openai_api.responses import sse
from kubesgl.protocol import FinishReason, TokenLogprob
from kubesgl.services.gateway.encoders import ChatEncoder, CompletionEncoder, NativeEncoder
from kubesgl.services.gateway.generation import ChoiceEvent
from kubesgl.tool_formats import ToolCallStream
from kubesgl.tool_formats.qwen25 import FORMAT as QWEN25

# Every code point but the surrogates, cut into pieces: quotes, backslashes, control characters, emoji.
_ALL = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
_TEXTS = [" hello", '"\\\n\t\x00\x1f\u2028\u2029', "é中😀", _ALL[:5000], _ALL]


def _pair(kind: str, include_usage: bool) -> tuple[object, object]:
    """Two encoders of one request (same id, clock, model): one gives frames, the other chunks."""
    rid, model = 'cmpl-"q\\uote', "Qwen/Qwen3 é"
    if kind == "completion":
        a, b = (
            CompletionEncoder(rid, model, 2, include_usage),
            CompletionEncoder(rid, model, 2, include_usage),
        )
    else:
        a, b = ChatEncoder(rid, model, 2, include_usage), ChatEncoder(rid, model, 2, include_usage)
    b.created = a.created
    return a, b


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("include_usage", [False, True])
def test_frames_are_the_bytes_of_the_chunks_they_stand_for(kind: str, include_usage: bool) -> None:
    fast, slow = _pair(kind, include_usage)
    lp = [TokenLogprob(5, -0.5)]
    events = [ChoiceEvent(i, t, [1, 2], None, 7, 1, n) for n, t in enumerate(_TEXTS) for i in (0, 1)]
    events += [
        ChoiceEvent(0, "x", [3], lp, 7, 1, 9),  # logprobs
        ChoiceEvent(1, "", [4], None, 7, 1, 9),  # no text
        ChoiceEvent(0, " end", [5], None, 7, 1, 10, FinishReason.STOP, 5),  # the last
    ]
    for event in events:
        assert fast.frames(event) == b"".join(sse(c) for c in slow.chunks(event))
    assert fast.usage_chunk() == slow.usage_chunk()  # the progress both kept is the same


def test_a_choice_parsed_for_tool_calls_takes_the_chunk_path(monkeypatch: pytest.MonkeyPatch) -> None:
    # A call's id is random: both encoders get the same one.
    same_id = functools.partial(ToolCallStream, id_factory=lambda: "call_" + "0" * 24)
    monkeypatch.setattr("kubesgl.services.gateway.encoders.ToolCallStream", same_id)
    fmt = QWEN25
    fast = ChatEncoder("c", "m", 1, False, tool_format=lambda _: fmt)
    slow = ChatEncoder("c", "m", 1, False, tool_format=lambda _: fmt)
    slow.created = fast.created
    pieces = ["Hi ", '<tool_call>{"name": "f", ', '"arguments": {"a": 1}}</tool_call>']
    for k, piece in enumerate(pieces):
        event = ChoiceEvent(0, piece, [k], None, finish_reason=FinishReason.STOP if k == 2 else None)
        assert fast.frames(event) == b"".join(sse(c) for c in slow.chunks(event))


def test_native_frames_are_its_cumulative_chunks() -> None:
    fast, slow = NativeEncoder("r"), NativeEncoder("r")
    for k, piece in enumerate(["a", "b", "c"]):
        event = ChoiceEvent(0, piece, [k], None, 3, 0, k + 1)
        assert fast.frames(event) == b"".join(sse(c) for c in slow.chunks(event))
