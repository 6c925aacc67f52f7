"""One request's life inside the engine: its tokens, its KV pages, and how far it has got."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from kubesgl.errors import KubesglError
from kubesgl.structured.compiler import CompiledConstraint
from kubesgl.structured.matcher import GrammarState
from kubesgl.values.outputs import FinishReason, TokenLogprob
from kubesgl.values.sampling import SamplingParams


class ReqState(enum.Enum):
    WAITING = "waiting"  # queued, or preempted and queued again
    RUNNING = "running"  # holds a slot and pages; prefilling (maybe in chunks) or decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Req:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling seed (params.seed, or drawn from the engine's RNG)
    arrival: int  # admission order, for FIFO and preemption choice
    max_new_tokens: int  # params.max_tokens, or what an open-ended request may generate
    output_ids: list[int] = field(default_factory=list)
    state: ReqState = ReqState.WAITING
    slot: int = -1  # row in the runner's token pool / page table
    pages: list[int] = field(default_factory=list)
    tree_pages: int = 0  # pages[:tree_pages] belong to the prefix cache (locked by cache_handle)
    cache_handle: object = None
    kv_len: int = 0  # tokens whose KV is computed or being computed by a launched batch
    prefill_target: int = 0  # tokens that need KV before decoding starts (prompt, + outputs after preemption)
    pending: int = 0  # tokens sampled by launched batches whose values the host has not seen yet
    cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    finish_reason: FinishReason | None = None
    emitted: int = 0  # output tokens already reported
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # gathered across prefill chunks
    prompt_logprobs_sent: bool = False
    # The next prompt position whose logprob no launched step computes yet (by the logits one position before
    # it); None when none is left, or none was asked for.
    prompt_logprob_next: int | None = None
    # Structured outputs: the grammar being compiled (the request waits), then its matcher, which advances with
    # every token the host reads back.
    grammar_future: Future[CompiledConstraint] | None = None
    grammar: GrammarState | None = None
    error: KubesglError | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.input_ids + self.output_ids

    @property
    def num_known(self) -> int:
        return len(self.input_ids) + len(self.output_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.kv_len < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.state is ReqState.FINISHED
