"""What the Python load generators send: the prompt-length mix (PROMPT_MIX) and OpenAI request bodies.

Shared by locust/locustfile.py and replay.py; it imports nothing from kubesgl so the load tests run from any
machine with just locust or httpx installed. The k6 script (JavaScript) implements the same PROMPT_MIX format.

PROMPT_MIX is "WORDS:WEIGHT,..." e.g. "16:6,128:3,1024:1": prompts of 16, 128 or 1024 words, picked with
weights 6:3:1. One word of the vocabulary below is one token for common BPE tokenizers (Qwen, Llama).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

DEFAULT_PROMPT_MIX = "16:6,128:3,512:1"

# fmt: off
_WORDS = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world", "school",
    "state", "family", "student", "group", "country", "problem", "hand", "part", "place", "case", "week",
    "company", "system", "program", "question", "work", "government", "number", "night", "point", "home",
    "water", "room", "mother", "area", "money", "story", "fact", "month", "lot", "right", "study", "book",
    "eye", "job", "word", "business", "issue", "side", "kind", "head", "house", "service", "friend",
    "father", "power", "hour", "game", "line", "end", "member", "law",
)
# fmt: on


@dataclass(frozen=True)
class PromptMix:
    """Prompt lengths in words and their relative weights."""

    lengths: tuple[int, ...]
    weights: tuple[float, ...]

    @classmethod
    def parse(cls, spec: str) -> PromptMix:
        """Parses "WORDS:WEIGHT,..." (a bare "WORDS" has weight 1); ValueError naming the bad part."""
        lengths, weights = [], []
        for part in spec.split(","):
            part = part.strip()
            if not part:
                continue
            words, _, weight = part.partition(":")
            try:
                n, w = int(words), float(weight or 1)
            except ValueError:
                raise ValueError(f"PROMPT_MIX part {part!r} is not WORDS:WEIGHT") from None
            if n < 1 or w <= 0:
                raise ValueError(f"PROMPT_MIX part {part!r}: WORDS must be >= 1 and WEIGHT > 0")
            lengths.append(n)
            weights.append(w)
        if not lengths:
            raise ValueError(f"PROMPT_MIX {spec!r} names no prompt length")
        return cls(tuple(lengths), tuple(weights))

    def pick(self, rng: random.Random) -> int:
        return rng.choices(self.lengths, weights=self.weights)[0]


def prompt_text(words: int, rng: random.Random) -> str:
    """A prompt of `words` random words: random so requests do not all hit the same cached prefix."""
    return "Summarize: " + " ".join(rng.choice(_WORDS) for _ in range(words))


def chat_body(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """A streaming chat completion that asks for the usage chunk at the end."""
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def completion_body(model: str, input_ids: list[int], output_len: int) -> dict[str, Any]:
    """A streaming completion of exactly `output_len` tokens from exactly these prompt tokens (trace replay)."""
    return {
        "model": model,
        "prompt": input_ids,
        "max_tokens": output_len,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def auth_headers(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}
