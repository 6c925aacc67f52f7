"""What the engine reports back to whoever drives it (the offline LLM or the scheduler service)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first


@dataclass
class RequestOutput:
    """New tokens of one request since its last output; `finished` is set on the last one."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # total so far, including new_token_ids
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # set with finish_reason "abort" when the engine rejected or failed it


@dataclass(frozen=True)
class ModelInfo:
    name: str
    architecture: str
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    page_size: int
    num_pages: int
    load_weights_s: float = 0.0  # reading the checkpoint onto the device (sglang:engine_load_weights_time)
    startup_s: float = (
        0.0  # the engine's whole start: ranks, weights, KV pool, CUDA graphs (sglang:engine_startup_time)
    )


@dataclass
class EngineStats:
    num_running: int
    num_queued: int
    free_pages: int  # in the pool, not counting evictable cache
    available_pages: int  # free + evictable prefix cache
    total_pages: int
    cached_prefix_pages: int
    prompt_tokens_total: int = 0
    cached_tokens_total: int = 0
    generation_tokens_total: int = 0
    retracted_total: int = 0  # requests preempted (retracted) to free KV pages for others, since start

    @property
    def token_usage(self) -> float:
        """Share of KV pages held by running requests (SGLang's token_usage)."""
        return 1.0 - self.available_pages / max(self.total_pages, 1)
