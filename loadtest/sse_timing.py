"""Client-side timing of one streamed OpenAI completion: time to first token and the gaps between tokens,
taken as each server-sent event arrives. Shared by locust/locustfile.py, replay.py and soak.py."""

from __future__ import annotations

import json
from typing import Any


class StreamTimer:
    """Feed it each SSE line as it arrives, with the time it arrived; read the results at the end."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.ttft: float | None = None
        self.itls: list[float] = []  # gaps between content chunks (one token each unless the server merged)
        self.chunks = 0
        self.done = False  # saw "data: [DONE]"
        self.finish_reason: str | None = None
        self.completion_tokens: int | None = None  # from the usage chunk
        self.error: str | None = None
        self.error_type: str | None = None  # the error event's OpenAI `type` (e.g. "timeout")
        self._last: float | None = None

    def on_line(self, line: str | bytes, now: float) -> None:
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        line = line.strip()
        if not line.startswith("data:"):
            return  # blank separators, comments, event names
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"malformed event: {data[:200]}"
            return
        self._on_event(event, now)

    def _on_event(self, event: dict[str, Any], now: float) -> None:
        if "error" in event:
            self.error = str(event["error"].get("message", event["error"]))
            self.error_type = event["error"].get("type")
            return
        usage = event.get("usage")
        if usage:
            self.completion_tokens = usage.get("completion_tokens")
        for choice in event.get("choices", []):
            text = choice.get("text") or (choice.get("delta") or {}).get("content")
            if text:
                if self._last is None:
                    self.ttft = now - self.start
                else:
                    self.itls.append(now - self._last)
                self._last = now
                self.chunks += 1
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def failure(self) -> str | None:
        """Why the stream does not count as a success, or None."""
        if self.error:
            return self.error
        if not self.done:
            return "stream ended without [DONE]"
        if self.finish_reason is None:
            return "no choice finished"
        return None
