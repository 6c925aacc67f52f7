"""What the engine reports back to whoever drives it (the offline LLM or the scheduler service)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from kubesgl.errors import KubesglError


class FinishReason(StrEnum):
    STOP = "stop"  # an EOS or stop token (the gateway also ends a choice on a stop string)
    LENGTH = "length"  # max_tokens, or the end of the context
    ABORT = "abort"  # aborted, or failed: the request's error says why


@dataclass(frozen=True)
class TokenLogprob:
    """One token's logprob (a generated token's, or a prompt token's) and its best alternatives: the engine
    fills the ids and logprobs, the detokenizer the text (the same value all the way to the HTTP response).
    `logprob` is None only for the first prompt token, which has nothing before it to be predicted from."""

    token_id: int
    logprob: float | None
    top: tuple[tuple[int, float], ...] = ()  # (token_id, logprob), best first
    token: str | None = None  # the token's text, or `bytes:\xNN...` for part of a UTF-8 character
    token_bytes: bytes | None = None
    top_tokens: tuple[str, ...] = ()  # the text of each of `top`
    top_bytes: tuple[bytes, ...] = ()


@dataclass
class RequestOutput:
    """New tokens of one request since its last output; `finished` is set on the last one."""

    rid: str
    new_token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # total so far, including new_token_ids
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    # With LogprobOptions.prompt_start: the prompt tokens' from there on, once, on the request's first output.
    prompt_logprobs: list[TokenLogprob] | None = None
    error: KubesglError | None = None  # why a request ended with ABORT inside the engine (its grammar failed)

    def __reduce__(self) -> tuple[type[RequestOutput], tuple[object, ...]]:
        # Every step's outputs cross the engine process's pipe pickled (services/scheduler/engine_process.py):
        # as the constructor's arguments they dump in 0.6x and load in 0.3x the time of the default (each
        # object's __dict__), ~1 us per output token less between the two processes.
        return RequestOutput, (
            self.rid,
            self.new_token_ids,
            self.prompt_tokens,
            self.cached_tokens,
            self.completion_tokens,
            self.finished,
            self.finish_reason,
            self.logprobs,
            self.prompt_logprobs,
            self.error,
        )


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
    pending_prefill_tokens: int = 0  # queued requests' tokens and running prefills' rest (Scheduler)

    @property
    def token_usage(self) -> float:
        """Share of KV pages held by running requests (SGLang's token_usage)."""
        return 1.0 - self.available_pages / max(self.total_pages, 1)
