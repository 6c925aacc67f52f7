"""What a benchmark client sees of one streamed request: TTFT, gaps between chunks, usage; and percentiles."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestTiming:
    ttft: float | None = None
    sent: float | None = None  # seconds until the request was written (the client's own send queue)
    gaps: list[float] = field(default_factory=list)
    first: float | None = None
    last: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None

    def on_event(self, event: dict[str, Any], now: float) -> None:
        """Takes one SSE event of /v1/completions (`now`: seconds since the request was sent)."""
        if "error" in event:
            self.error = str(event["error"].get("message"))
            return
        if usage := event.get("usage"):
            self.completion_tokens = usage["completion_tokens"]
            self.prompt_tokens = usage["prompt_tokens"]
            self.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        if any(c.get("text") for c in event.get("choices", ())):
            if self.first is None:
                self.ttft = self.first = now
            else:
                self.gaps.append(now - (self.last or now))
            self.last = now


def percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 4) if values else None
