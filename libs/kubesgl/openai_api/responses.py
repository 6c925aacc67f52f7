"""Builders for OpenAI response bodies and SSE chunks (chat.completion, text_completion) and the native
/generate body. Pure functions of finished or partial choices."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kubesgl.openai_api.logprobs import chat_logprobs, completion_logprobs, native_logprobs
from kubesgl.tool_formats import ParsedOutput
from kubesgl.values.outputs import FinishReason, TokenLogprob


@dataclass
class ChoiceResult:
    """One finished choice as the gateway assembled it."""

    index: int
    text: str
    finish_reason: FinishReason | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # per-token entries, None when not requested
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    matched_stop: str | int | None = None
    prompt_logprobs: list[TokenLogprob] | None = None  # native logprob_start_len


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def usage_of(choices: list[ChoiceResult], num_prompts: int = 1) -> dict[str, Any]:
    """Each prompt is counted once even when fanned out to n choices (OpenAI's rule); completions are summed."""
    n = max(len(choices) // max(num_prompts, 1), 1)
    firsts = choices[::n]
    return usage(
        sum(c.prompt_tokens for c in firsts),
        sum(c.completion_tokens for c in choices),
        sum(c.cached_tokens for c in firsts),
    )


def chat_response(
    rid: str,
    created: int,
    model: str,
    choices: list[ChoiceResult],
    tool_outputs: Mapping[int, ParsedOutput] | None = None,
) -> dict[str, Any]:
    """`tool_outputs`: the choices whose text was parsed for tool calls, by index."""
    return {
        "id": rid,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": [_chat_choice(c, (tool_outputs or {}).get(c.index)) for c in choices],
        "usage": usage_of(choices),
    }


def _chat_choice(c: ChoiceResult, parsed: ParsedOutput | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
    finish_reason: str | None = c.finish_reason
    if parsed is not None:
        message["content"] = parsed.content
        if parsed.tool_calls:
            message["tool_calls"] = [call.to_openai() for call in parsed.tool_calls]
        finish_reason = parsed.finish_reason(c.finish_reason) if c.finish_reason is not None else None
    return {
        "index": c.index,
        "message": message,
        "logprobs": None if c.logprobs is None else chat_logprobs(c.logprobs),
        "finish_reason": finish_reason,
    }


def completion_response(
    rid: str, created: int, model: str, choices: list[ChoiceResult], num_prompts: int
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": None if c.logprobs is None else completion_logprobs(c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_of(choices, num_prompts),
    }


def chat_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    delta: dict[str, Any],
    logprobs: list[TokenLogprob] | None = None,
    finish_reason: str | None = None,
) -> dict[str, Any]:
    """`finish_reason`: a FinishReason, or "tool_calls" when the choice ended after calling tools."""
    return {
        "id": rid,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "delta": delta,
                "logprobs": None if logprobs is None else chat_logprobs(logprobs),
                "finish_reason": finish_reason,
            }
        ],
    }


def completion_chunk(
    rid: str,
    created: int,
    model: str,
    index: int,
    text: str,
    logprobs: list[TokenLogprob] | None = None,
    text_offset: int = 0,
    finish_reason: FinishReason | None = None,
) -> dict[str, Any]:
    return {
        "id": rid,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": index,
                "text": text,
                "logprobs": None if logprobs is None else completion_logprobs(logprobs, text_offset),
                "finish_reason": finish_reason,
            }
        ],
    }


def usage_chunk(rid: str, created: int, model: str, obj: str, usage_body: dict[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream with stream_options.include_usage: no choices, only usage."""
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": usage_body}


def native_response(rid: str, choice: ChoiceResult, text: str | None = None) -> dict[str, Any]:
    """SGLang's /generate body; streams send the cumulative `text` so far (SGLang's convention)."""
    meta: dict[str, Any] = {
        "id": rid,
        "prompt_tokens": choice.prompt_tokens,
        "completion_tokens": choice.completion_tokens,
        "cached_tokens": choice.cached_tokens,
        "finish_reason": None
        if choice.finish_reason is None
        else {"type": choice.finish_reason, "matched": choice.matched_stop},
    }
    if choice.logprobs is not None:
        meta.update(native_logprobs(choice.logprobs, choice.prompt_logprobs))
    return {"text": choice.text if text is None else text, "output_ids": choice.token_ids, "meta_info": meta}


def sse(body: dict[str, Any] | str) -> bytes:
    """One server-sent event; `[DONE]` is passed as the plain string. A chunk without logprobs (a stream's
    per-token chunks, its usage chunk) is encoded by msgspec, 7x faster than json.dumps and byte for byte what
    json.dumps writes for strings, ints and null; a body that may hold floats keeps json's spelling of them
    (`1e-07`, `-Infinity`, where msgspec writes `1e-7`, `null`)."""
    if isinstance(body, str):
        return b"data: " + body.encode() + b"\n\n"
    choices = body.get("choices")
    if choices is not None and all(c.get("logprobs") is None for c in choices):
        return b"data: " + _JSON.encode(body) + b"\n\n"
    return b"data: " + json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


_JSON = msgspec.json.Encoder()


class PlainTextFrames:
    """One stream's SSE events for a plain text piece (no logprobs, no finish_reason), pre-encoded: the bytes
    `sse(completion_chunk(...))` / `sse(chat_chunk(...))` write for it (`usage: null` after the choices with
    include_usage), with only the text encoded per event. The bytes around the text are made once per choice
    index from the same encoder, so they are the same bytes (tests/unit/gateway/test_gateway_encoders.py pins
    it for every code point)."""

    def __init__(
        self, rid: str, created: int, model: str, obj: str, key: str, include_usage: bool, wrap: bytes = b""
    ) -> None:
        """`key`: the choice's field that holds the text ("text"; "delta" for chat, with `wrap` b'{"content":'
        opening the object the text sits in)."""
        self._head = (
            b'data: {"id":' + _JSON.encode(rid) + b',"object":' + _JSON.encode(obj) + b',"created":'
            + _JSON.encode(created) + b',"model":' + _JSON.encode(model) + b',"choices":[{"index":'
        )  # fmt: skip
        self._key = b',"' + key.encode() + b'":' + wrap
        self._tail = (b"}" if wrap else b"") + b',"logprobs":null,"finish_reason":null}]'
        self._tail += b',"usage":null}\n\n' if include_usage else b"}\n\n"
        self._heads: dict[int, bytes] = {}

    def frame(self, index: int, text: str) -> bytes:
        head = self._heads.get(index)
        if head is None:
            head = self._heads[index] = self._head + _JSON.encode(index) + self._key
        return head + _JSON.encode(text) + self._tail
