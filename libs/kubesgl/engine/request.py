"""One request's life inside the engine: its tokens, its KV pages, and how far it has got."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field

from kubesgl.errors import KubesglError
from kubesgl.kv.prefix_cache import CacheHandle
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
    """A request's fields change together through its transitions: `admit`, `hold_cached_prefix`, `release`,
    `finish`; the rest (kv_len, pending, outputs) advance a step at a time."""

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
    cache_handle: CacheHandle | None = None
    kv_len: int = 0  # tokens whose KV is computed or being computed by a launched batch
    prefill_target: int = 0  # tokens that need KV before decoding starts (prompt, + outputs after preemption)
    pending: int = 0  # tokens sampled by launched batches whose values the host has not seen yet
    cached_tokens: int = -1  # prefix-cache hit at first admission (-1: not admitted yet)
    finish_reason: FinishReason | None = None
    emitted: int = 0  # output tokens already reported
    resumed: int = (
        0  # output tokens that existed at admission (a resumed request): no logprobs of theirs here
    )
    logprobs: list[TokenLogprob] = field(default_factory=list)  # of output_ids[resumed:]
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
    # Disaggregation (prefill role): after its first token the request leaves for a decode instance, its
    # prompt's KV locked in the prefix cache until the transfer ends (engine/scheduler/disagg.py).
    hand_off: bool = False

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

    @property
    def cacheable_len(self) -> int:
        """How many leading tokens admission may take from the prefix cache: all but the last known one (its
        logits give the next token), and none whose prompt logprob is still to compute (a cached prefix has no
        logits)."""
        limit = self.num_known - 1
        return limit if self.prompt_logprob_next is None else min(self.prompt_logprob_next - 1, limit)

    def admit(self, slot: int, handle: CacheHandle | None, pages: list[int], page_size: int) -> None:
        """Running in `slot`, holding the KV of its cached prefix (`pages`, locked by `handle`); what it knows
        but the cache did not give is to prefill."""
        self.state = ReqState.RUNNING
        self.slot = slot
        self.prefill_target = self.num_known
        self.cache_handle, self.pages, self.tree_pages = handle, list(pages), len(pages)
        self.kv_len = len(pages) * page_size
        if self.cached_tokens < 0:
            self.cached_tokens = self.kv_len

    def hold_cached_prefix(self, handle: CacheHandle | None, pages: list[int]) -> bool:
        """The prefix cache now owns the request's first len(pages) pages under `handle`; `pages` are the
        cache's (an identical copy cached earlier replaces ours). True when they differ from the ones held."""
        replaced = pages != self.pages[: len(pages)]
        self.pages[: len(pages)] = pages
        self.cache_handle, self.tree_pages = handle, len(pages)
        return replaced

    def release(self) -> None:
        """Holds no slot, pages or cache lock any more (the caller gave them back); waits to be admitted again."""
        self.state = ReqState.WAITING
        self.slot, self.pages, self.tree_pages, self.cache_handle, self.kv_len = -1, [], 0, None, 0

    def finish(self, reason: FinishReason) -> None:
        """Done (its memory released first); the matcher goes, a compile shared with others keeps running."""
        self.state = ReqState.FINISHED
        self.finish_reason = reason
        self.grammar = self.grammar_future = None
