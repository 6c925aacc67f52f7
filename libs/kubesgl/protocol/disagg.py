"""Disaggregated serving: a decode instance has a prefill instance compute a prompt (PrefillAsk), takes the
first token and the KV pages' descriptors (PrefillDone), and lets the pages go (KvRelease);
engine/scheduler/disagg.py."""

from __future__ import annotations

from dataclasses import dataclass

from kubesgl.protocol.message import Message
from kubesgl.values.outputs import FinishReason, TokenLogprob
from kubesgl.values.sampling import SamplingParams


@dataclass
class PrefillAsk(Message):
    """decode instance -> prefill instance: compute this prompt and its first token, hand the KV back."""

    rid: str
    decode_instance: str
    input_ids: list[int]
    sampling: SamplingParams
    deadline: float


@dataclass
class PrefillDone(Message):
    """prefill instance -> decode instance: the first token(s), and NIXL's descriptors of the prompt's full KV
    pages (engine/scheduler/disagg.py). `finished`: the request ended at its first token; nothing to pull."""

    rid: str
    seed: int
    new_token_ids: list[int]
    cached_tokens: int
    num_pages: int
    agent_metadata: bytes
    descs: bytes
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None


@dataclass
class KvRelease(Message):
    """decode instance -> prefill instance: done with the handoff's pages (pulled, or given up)."""

    rid: str
