"""Per-request sampling parameters (the public `SamplingParams`)."""

from __future__ import annotations

from dataclasses import dataclass

from kubesgl.errors import InvalidRequestError


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 means greedy; top_k -1 and top_p 1 mean off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    def validate(self) -> None:
        """Raises InvalidRequestError naming the offending field."""
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0, "temperature", "must be >= 0"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", "must be -1 (off) or >= 1"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", "must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty", "must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty", "must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty", "must be > 0"),
            (0 <= self.top_logprobs <= 20, "top_logprobs", "must be in [0, 20]"),
            (self.seed is None or 0 <= self.seed < 2**63, "seed", "must be a non-negative 64-bit integer"),
        ]
        for ok, field, why in checks:
            if not ok:
                raise InvalidRequestError(f"{field} {why} (got {getattr(self, field)!r})", param=field)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
