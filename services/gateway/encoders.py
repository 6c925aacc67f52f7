"""How each endpoint renders choice events: the chat, completions and native (/generate) bodies, streamed as
SSE chunks or built whole at the end. One encoder per request; it tracks per-choice state (text offsets,
usage) while the stream runs."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from kubesgl.openai_api.responses import (
    ChoiceResult,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    native_response,
    usage_chunk,
    usage_of,
)
from kubesgl.services.gateway.generation import ChoiceEvent


class Encoder(Protocol):
    def prelude(self) -> list[dict[str, Any]]: ...
    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]: ...
    def usage_chunk(self) -> dict[str, Any]: ...
    def final(self, results: list[ChoiceResult]) -> dict[str, Any]: ...


@dataclass
class _Progress:
    """What a stream has sent so far for each choice; enough for the usage chunk and text offsets."""

    results: dict[int, ChoiceResult] = field(default_factory=dict)

    def add(self, event: ChoiceEvent) -> ChoiceResult:
        r = self.results.setdefault(event.index, ChoiceResult(event.index, "", None))
        r.text += event.text
        r.token_ids.extend(event.token_ids)
        r.prompt_tokens = max(r.prompt_tokens, event.prompt_tokens)
        r.cached_tokens = max(r.cached_tokens, event.cached_tokens)
        r.completion_tokens = max(r.completion_tokens, event.completion_tokens)
        r.finish_reason, r.matched_stop = event.finish_reason, event.matched_stop
        if event.logprobs is not None:
            r.logprobs = [*(r.logprobs or []), *event.logprobs]
        if event.prompt_logprobs is not None:
            r.prompt_logprobs = event.prompt_logprobs
        return r

    def ordered(self) -> list[ChoiceResult]:
        return [self.results[i] for i in sorted(self.results)]


class ChatEncoder:
    def __init__(self, rid: str, model: str, n: int, include_usage: bool) -> None:
        self.rid, self.model, self.n = rid, model, n
        self.created = int(time.time())
        self._include_usage = include_usage
        self._progress = _Progress()

    def prelude(self) -> list[dict[str, Any]]:
        return [
            self._chunk(
                chat_chunk(self.rid, self.created, self.model, i, {"role": "assistant", "content": ""})
            )
            for i in range(self.n)
        ]

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        self._progress.add(event)
        if not (event.text or event.logprobs or event.finish_reason):
            return []
        delta = {"content": event.text} if event.text else {}
        logprobs = event.logprobs if event.logprobs else None
        chunk = chat_chunk(
            self.rid, self.created, self.model, event.index, delta, logprobs, event.finish_reason
        )
        return [self._chunk(chunk)]

    def usage_chunk(self) -> dict[str, Any]:
        body = usage_of(self._progress.ordered())
        return usage_chunk(self.rid, self.created, self.model, "chat.completion.chunk", body)

    def final(self, results: list[ChoiceResult]) -> dict[str, Any]:
        return chat_response(self.rid, self.created, self.model, results)

    def _chunk(self, chunk: dict[str, Any]) -> dict[str, Any]:
        if self._include_usage:
            chunk["usage"] = None  # OpenAI: with include_usage every chunk carries usage, null until the last
        return chunk


class CompletionEncoder:
    def __init__(self, rid: str, model: str, num_prompts: int, include_usage: bool) -> None:
        self.rid, self.model, self.num_prompts = rid, model, num_prompts
        self.created = int(time.time())
        self._include_usage = include_usage
        self._progress = _Progress()

    def prelude(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        offset = len(self._progress.results[event.index].text) if event.index in self._progress.results else 0
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
        self._progress = _Progress()

    def prelude(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        r = self._progress.add(event)
        if not (event.text or event.token_ids or event.finish_reason):
            return []
        return [native_response(self.rid, r)]

    def usage_chunk(self) -> dict[str, Any]:
        return {}

    def final(self, results: list[ChoiceResult]) -> dict[str, Any]:
        return native_response(self.rid, results[0])
