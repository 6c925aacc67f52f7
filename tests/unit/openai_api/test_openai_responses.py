"""Response builders: OpenAI body shapes, usage accounting, logprob formats, wire errors."""

from __future__ import annotations

import json

from kubesgl.errors import ContextLengthError
from kubesgl.openai_api.http_errors import error_body
from kubesgl.openai_api.responses import (
    ChoiceResult,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    sse,
    usage_of,
)
from kubesgl.protocol import ErrorInfo, FinishReason, TokenLogprob

LP = [
    TokenLogprob(5, -0.1, ((5, -0.1),), token="he", token_bytes=bytes([104, 101]), top_tokens=("he",)),
    TokenLogprob(6, -0.2, token="llo", token_bytes=bytes([108, 108, 111])),
]


def _choice(i: int, **kw) -> ChoiceResult:
    return ChoiceResult(
        i, "hello", FinishReason.STOP, prompt_tokens=10, cached_tokens=4, completion_tokens=2, **kw
    )


def test_usage_counts_each_prompt_once_and_sums_completions() -> None:
    u = usage_of([_choice(0), _choice(1)])
    assert u == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert usage_of([_choice(i) for i in range(4)], num_prompts=2)["prompt_tokens"] == 20


def test_chat_response_shape_with_logprobs() -> None:
    body = chat_response("chatcmpl-1", 1, "m", [_choice(0, logprobs=LP)])
    c = body["choices"][0]
    assert body["object"] == "chat.completion" and c["message"] == {
        "role": "assistant",
        "content": "hello",
        "refusal": None,
    }
    assert [e["token"] for e in c["logprobs"]["content"]] == ["he", "llo"]
    assert c["logprobs"]["content"][0]["top_logprobs"][0] == {"token": "he", "logprob": -0.1, "bytes": None}


def test_completion_logprobs_carry_text_offsets() -> None:
    body = completion_response("cmpl-1", 1, "m", [_choice(0, logprobs=LP)], 1)
    lp = body["choices"][0]["logprobs"]
    assert (
        lp["tokens"] == ["he", "llo"]
        and lp["text_offset"] == [0, 2]
        and lp["top_logprobs"][0] == {"he": -0.1}
    )
    chunk = completion_chunk("cmpl-1", 1, "m", 0, "llo", LP[1:], text_offset=2)
    assert chunk["choices"][0]["logprobs"]["text_offset"] == [2]


def test_chunks_and_sse_framing() -> None:
    chunk = chat_chunk("id", 1, "m", 1, {"content": "é"}, finish_reason="length")
    assert chunk["choices"][0]["finish_reason"] == "length" and chunk["choices"][0]["index"] == 1
    raw = sse(chunk)
    assert raw.startswith(b"data: ") and raw.endswith(b"\n\n")
    assert json.loads(raw[6:]) == chunk
    assert sse("[DONE]") == b"data: [DONE]\n\n"


def test_sse_bytes_are_json_dumps_bytes_for_every_text_and_float() -> None:
    # Every code point but the surrogates, in one text: quotes, backslashes, control characters, emoji.
    text = "".join(chr(c) for c in range(0x110000) if not 0xD800 <= c <= 0xDFFF)
    chunks = [
        completion_chunk("cmpl-1", 1, "m", 0, text, finish_reason=FinishReason.STOP),
        chat_chunk("id", 1, "m", 0, {"content": text}),
        completion_chunk(
            "cmpl-1", 1, "m", 0, "he", [TokenLogprob(5, -3.8e-07), TokenLogprob(6, float("-inf"))]
        ),
        {"id": "x", "choices": [], "usage": usage_of([ChoiceResult(0, "a", None, completion_tokens=3)])},
    ]
    for chunk in chunks:
        data = json.dumps(chunk, separators=(",", ":"), ensure_ascii=False)
        assert sse(chunk) == f"data: {data}\n\n".encode()


def test_wire_errors_keep_their_status_and_code() -> None:
    err = ErrorInfo(
        status=400, type="invalid_request_error", code="context_length_exceeded", message="long"
    ).to_error()
    assert isinstance(err, ContextLengthError) and err.status == 400
    assert error_body(err) == {
        "error": {
            "message": "long",
            "type": "invalid_request_error",
            "param": None,
            "code": "context_length_exceeded",
        }
    }
    assert ErrorInfo(status=503, type="", message="gone").to_error().type == "service_unavailable"
