"""How each endpoint renders choice events: the chat, completions and native (/generate) bodies, streamed as
SSE chunks or built whole at the end. One encoder per request; it tracks per-choice state (text offsets,
usage) while the stream runs."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubesgl.openai_api.responses import (
    ChoiceResult,
    PlainTextFrames,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    native_response,
    sse,
    usage_chunk,
    usage_of,
)
from kubesgl.services.gateway.generation import ChoiceEvent
from kubesgl.tool_formats import (
    ParsedOutput,
    ToolCallFormat,
    ToolCallStream,
    parse_tool_calls,
    tool_finish_reason,
)


class Encoder(Protocol):
    """What the responder asks of an endpoint's encoder: `frames(event)`, the SSE bytes of one event (its
    `chunks(event)`, each as an event, where the encoder has no pre-encoded form for it)."""

    def prelude(self) -> list[dict[str, Any]]: ...
    def frames(self, event: ChoiceEvent) -> bytes: ...
    def usage_chunk(self) -> dict[str, Any]: ...
    def final(self, results: list[ChoiceResult]) -> dict[str, Any]: ...


@dataclass
class _Progress:
    """What a stream has sent so far for each choice: its token counts (the usage chunk) and its text's length
    (completions' text_offset). With `whole`, its text, token ids and logprobs so far too, which the native
    endpoint's chunks carry whole; the OpenAI chunks carry only what is new, and keeping the rest copied the text
    so far at every event (quadratic in a stream's length)."""

    whole: bool = False
    results: dict[int, ChoiceResult] = field(default_factory=dict)
    chars: dict[int, int] = field(default_factory=dict)  # text length so far, by choice index

    def add(self, event: ChoiceEvent) -> ChoiceResult:
        r = self.results.get(event.index)
        if r is None:  # not setdefault: that built a ChoiceResult per event to throw away
            r = self.results[event.index] = ChoiceResult(event.index, "", None)
        if self.whole:
            r.text += event.text
            r.token_ids.extend(event.token_ids)
            if event.logprobs is not None:
                r.logprobs = [*(r.logprobs or []), *event.logprobs]
            if event.prompt_logprobs is not None:
                r.prompt_logprobs = event.prompt_logprobs
        self.chars[event.index] = self.chars.get(event.index, 0) + len(event.text)
        r.prompt_tokens = max(r.prompt_tokens, event.prompt_tokens)
        r.cached_tokens = max(r.cached_tokens, event.cached_tokens)
        r.completion_tokens = max(r.completion_tokens, event.completion_tokens)
        r.finish_reason, r.matched_stop = event.finish_reason, event.matched_stop
        return r

    def ordered(self) -> list[ChoiceResult]:
        """Each choice's results by index: its counts always, its text, ids and logprobs only with `whole`."""
        return [self.results[i] for i in sorted(self.results)]


class ChatEncoder:
    """Chat bodies. A choice whose output is parsed for tool calls (`tool_format(index)` names the format once
    the choice is admitted) streams its calls as OpenAI does: a delta with the call's index, id, type and name,
    then its arguments in pieces; the text outside calls as content; finish_reason "tool_calls" once a call
    was made. With `parallel_tool_calls` false only the first call is kept."""

    def __init__(
        self,
        rid: str,
        model: str,
        n: int,
        include_usage: bool,
        tool_format: Callable[[int], ToolCallFormat | None] = lambda _: None,
        parallel_tool_calls: bool = True,
    ) -> None:
        self.rid, self.model, self.n = rid, model, n
        self.created = int(time.time())
        self._include_usage = include_usage
        self._progress = _Progress()
        self._tool_format = tool_format
        self._parallel = parallel_tool_calls
        self._tool_streams: dict[int, ToolCallStream | None] = {}
        self._plain = PlainTextFrames(
            rid, self.created, model, "chat.completion.chunk", "delta", include_usage, wrap=b'{"content":'
        )

    def prelude(self) -> list[dict[str, Any]]:
        return [
            self._chunk(
                chat_chunk(self.rid, self.created, self.model, i, {"role": "assistant", "content": ""})
            )
            for i in range(self.n)
        ]

    def frames(self, event: ChoiceEvent) -> bytes:
        """The event's SSE bytes: `chunks` as events, pre-encoded for a plain content delta."""
        if _plain(event) and self._calls(event) is None:
            self._progress.add(event)
            return self._plain.frame(event.index, event.text)
        return _sse_all(self.chunks(event))

    def _calls(self, event: ChoiceEvent) -> ToolCallStream | None:
        if event.index not in self._tool_streams:
            fmt = self._tool_format(event.index)
            self._tool_streams[event.index] = ToolCallStream(fmt) if fmt is not None else None
        return self._tool_streams[event.index]

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        self._progress.add(event)
        calls = self._calls(event)
        finish: str | None = event.finish_reason
        if calls is None:
            deltas = [{"content": event.text}] if event.text else []
        else:
            deltas = calls.push(event.text)
            if finish is not None:
                deltas += calls.finish()
                finish = tool_finish_reason(calls.made_calls, finish)
            deltas = [d for d in deltas if self._parallel or _first_call_only(d)]
        if not (deltas or event.logprobs or finish):
            return []
        # One delta a chunk (OpenAI's shape); the event's logprobs ride on its first, finish_reason on its last.
        deltas = deltas or [{}]
        last = len(deltas) - 1
        return [
            self._chunk(
                chat_chunk(
                    self.rid,
                    self.created,
                    self.model,
                    event.index,
                    d,
                    event.logprobs if i == 0 and event.logprobs else None,
                    finish if i == last else None,
                )
            )
            for i, d in enumerate(deltas)
        ]

    def usage_chunk(self) -> dict[str, Any]:
        body = usage_of(self._progress.ordered())
        return usage_chunk(self.rid, self.created, self.model, "chat.completion.chunk", body)

    def final(self, results: list[ChoiceResult]) -> dict[str, Any]:
        parsed = {}
        for r in results:
            if (fmt := self._tool_format(r.index)) is not None:
                out = parse_tool_calls(r.text, fmt)
                parsed[r.index] = out if self._parallel else ParsedOutput(out.content, out.tool_calls[:1])
        return chat_response(self.rid, self.created, self.model, results, parsed)

    def _chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self._include_usage:
            chunk["usage"] = None  # OpenAI: with include_usage every chunk carries usage, null until the last
        return chunk


def _plain(event: ChoiceEvent) -> bool:
    """Text alone, not the choice's last event: what PlainTextFrames writes."""
    return bool(event.text) and not event.logprobs and event.finish_reason is None


def _sse_all(chunks: list[dict[str, Any]]) -> bytes:
    return b"".join([sse(chunk) for chunk in chunks])


def _first_call_only(delta: dict[str, Any]) -> bool:
    return all(c["index"] == 0 for c in delta.get("tool_calls", ()))


class CompletionEncoder:
    def __init__(self, rid: str, model: str, num_prompts: int, include_usage: bool) -> None:
        self.rid, self.model, self.num_prompts = rid, model, num_prompts
        self.created = int(time.time())
        self._include_usage = include_usage
        self._progress = _Progress()
        self._plain = PlainTextFrames(rid, self.created, model, "text_completion", "text", include_usage)

    def prelude(self) -> list[dict[str, Any]]:
        return []

    def frames(self, event: ChoiceEvent) -> bytes:
        """The event's SSE bytes: `chunks` as events, pre-encoded for plain text."""
        if _plain(event):
            self._progress.add(event)
            return self._plain.frame(event.index, event.text)
        return _sse_all(self.chunks(event))

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        offset = self._progress.chars.get(event.index, 0)
        self._progress.add(event)
        if not (event.text or event.logprobs or event.finish_reason):
            return []
        logprobs = event.logprobs if event.logprobs else None
        chunk = completion_chunk(
            self.rid, self.created, self.model, event.index, event.text, logprobs, offset, event.finish_reason
        )
        if self._include_usage:
            chunk["usage"] = None
        return [chunk]

    def usage_chunk(self) -> dict[str, Any]:
        body = usage_of(self._progress.ordered(), self.num_prompts)
        return usage_chunk(self.rid, self.created, self.model, "text_completion", body)

    def final(self, results: list[ChoiceResult]) -> dict[str, Any]:
        return completion_response(self.rid, self.created, self.model, results, self.num_prompts)


class NativeEncoder:
    """SGLang's /generate: each streamed chunk carries the cumulative text and output ids so far."""

    def __init__(self, rid: str) -> None:
        self.rid = rid
        self._progress = _Progress(whole=True)

    def prelude(self) -> list[dict[str, Any]]:
        return []

    def frames(self, event: ChoiceEvent) -> bytes:
        return _sse_all(self.chunks(event))

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        r = self._progress.add(event)
        if not (event.text or event.token_ids or event.finish_reason):
            return []
        return [native_response(self.rid, r)]

    def usage_chunk(self) -> dict[str, Any]:
        return {}

    def final(self, results: list[ChoiceResult]) -> dict[str, Any]:
        return native_response(self.rid, results[0])
