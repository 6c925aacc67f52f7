"""Per-request sampling parameters (the public `SamplingParams`): one typed value from the HTTP edge to the
sampler, checked by `validate()` at the two gates it passes (the gateway's request models and
`Engine.add_request`)."""

from __future__ import annotations

from dataclasses import dataclass

from kubesgl.errors import InvalidRequestError
from kubesgl.values.constraint import Constraint

MAX_TOP_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's bound on each bias
MAX_LOGIT_BIAS_ENTRIES = 1024  # more is a mistake: each biased id costs the sampler a write


@dataclass(frozen=True)
class LogprobOptions:
    """Which logprobs a request gets back: each generated token's, with its `top` most likely alternatives, and
    from `prompt_start` on (SGLang's `logprob_start_len`; None: none) each prompt token's, computed in prefill.

    A prompt token's logprob is log P(token | the tokens before it); the first prompt token has none (its entry
    says None). The prefix cache is matched only up to `prompt_start`, since a cached prefix has no logits.
    """

    top: int = 0
    prompt_start: int | None = None


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens. temperature 0 (or top_k 1, or top_p 0: only the likeliest token's mass)
    means greedy; top_k -1 and top_p 1 mean off.

    `max_tokens` None means until the context ends (OpenAI's default), capped by the server's
    --default-max-tokens when one is set; the engine resolves it when it admits the request. 0 means prefill
    only (prompt logprobs with echo): the request ends after its prompt, with no token generated.
    `logit_bias`: (token id, bias) pairs added to the logits before sampling (ids distinct, checked against
    the vocabulary by the engine). `constraint`: the grammar the output must match (structured outputs).
    """

    max_tokens: int | None = 16
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
    logprobs: LogprobOptions | None = None  # None: no logprobs
    logit_bias: tuple[tuple[int, float], ...] = ()
    constraint: Constraint | None = None

    @property
    def greedy(self) -> bool:
        """The one definition of greedy: the argmax, no noise drawn."""
        return self.temperature == 0 or self.top_k == 1 or self.top_p == 0

    def validate(self) -> None:
        """Raises InvalidRequestError naming the offending field."""
        if self.logprobs is not None and not isinstance(self.logprobs, LogprobOptions):
            raise InvalidRequestError(
                f"logprobs must be LogprobOptions or None (got {self.logprobs!r})", param="logprobs"
            )
        top = self.logprobs.top if self.logprobs is not None else 0
        prompt_start = self.logprobs.prompt_start if self.logprobs is not None else None
        checks = [
            (
                self.max_tokens is None or self.max_tokens >= 0,
                "max_tokens",
                self.max_tokens,
                "must be at least 0",
            ),
            (self.temperature >= 0, "temperature", self.temperature, "must be >= 0"),
            (self.top_k == -1 or self.top_k >= 1, "top_k", self.top_k, "must be -1 (off) or >= 1"),
            (0 <= self.top_p <= 1, "top_p", self.top_p, "must be in [0, 1]"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]"),
            (
                -2 <= self.presence_penalty <= 2,
                "presence_penalty",
                self.presence_penalty,
                "must be in [-2, 2]",
            ),
            (
                -2 <= self.frequency_penalty <= 2,
                "frequency_penalty",
                self.frequency_penalty,
                "must be in [-2, 2]",
            ),
            (self.repetition_penalty > 0, "repetition_penalty", self.repetition_penalty, "must be > 0"),
            (0 <= top <= MAX_TOP_LOGPROBS, "top_logprobs", top, f"must be in [0, {MAX_TOP_LOGPROBS}]"),
            (
                prompt_start is None or prompt_start >= 0,
                "logprob_start_len",
                prompt_start,
                "must be >= 0",
            ),
            (
                self.seed is None or 0 <= self.seed < 2**63,
                "seed",
                self.seed,
                "must be a non-negative 64-bit integer",
            ),
        ]
        for ok, field, value, why in checks:
            if not ok:
                raise InvalidRequestError(f"{field} {why} (got {value!r})", param=field)
        self._validate_logit_bias()
        if self.constraint is not None and not isinstance(self.constraint, Constraint):
            raise InvalidRequestError(
                f"constraint must be a Constraint or None (got {self.constraint!r})", param="constraint"
            )

    def _validate_logit_bias(self) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise InvalidRequestError(
                f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES}",
                param="logit_bias",
            )
        seen: set[int] = set()
        for token_id, bias in self.logit_bias:
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise InvalidRequestError(
                    f"logit_bias for token {token_id} must be in [-100, 100] (got {bias!r})",
                    param="logit_bias",
                )
            if token_id < 0 or token_id in seen:
                why = "is negative" if token_id < 0 else "appears twice"
                raise InvalidRequestError(f"logit_bias token id {token_id} {why}", param="logit_bias")
            seen.add(token_id)
