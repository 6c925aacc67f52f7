"""One step's input and output: the BatchPlan every rank runs (decided on rank 0 and broadcast to the others),
and the StepTokens rank 0 reads back for the scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from kubesgl.values.outputs import TokenLogprob
from kubesgl.values.sampling import SamplingParams


@dataclass(frozen=True)
class SlotInit:
    """A request newly placed in a slot: its sampling parameters, kept on the device for its whole life."""

    slot: int
    prompt_len: int
    params: SamplingParams
    seed: int  # params.seed, or one drawn from the engine's RNG

    @property
    def seed_given(self) -> bool:
        """The client asked for this seed: sample reproducibly from it."""
        return self.params.seed is not None


@dataclass(frozen=True)
class PromptLogprobRows:
    """Prompt-token logprobs one extend row computes: the logits at `len(targets)` positions from `offset`
    within its chunk, each scored at the prompt token that follows it (`targets`), with `top` alternatives."""

    row: int
    offset: int
    targets: tuple[int, ...]
    top: int


@dataclass
class BatchPlan:
    """One forward + sample step over B requests (see AttentionMetadata for the length fields).

    A mixed step (`--enable-mixed-chunk`) is an extend plan whose last `num_decode` rows are decode rows
    riding along: one token each, at position prefix_lens[i], read from the token pool like a decode batch's
    (under overlap scheduling the host has not seen it yet). Every other field is per row for them too.
    """

    mode: Literal["extend", "decode"]
    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    tokens: list[int]  # the extend rows' new tokens, concatenated; decode rows' come from the token pool
    sample: list[bool]  # False for a prefill chunk that is not the request's last
    top_logprobs: list[int | None]  # per row: None no logprobs, else how many alternatives
    page_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (slot, first index, pages)
    slot_inits: list[SlotInit] = field(default_factory=list)
    num_decode: int = 0  # extend plans: trailing decode rows (a mixed step); decode plans: unused
    prompt_logprobs: list[PromptLogprobRows] = field(default_factory=list)  # extend plans only
    # Sampled rows (indices among the rows that sample) whose request has a grammar: the runner samples them
    # only once the host has filled their token bitmask (after the previous step's tokens were accepted).
    grammar_rows: list[int] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def num_extend(self) -> int:
        """Rows whose tokens are in `tokens` (all of an extend plan's but its trailing decode rows)."""
        return len(self.slots) - self.num_decode if self.mode == "extend" else 0

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]


@dataclass
class StepTokens:
    """What the host reads back after a step: per row of the plan, the sampled token (-1 where the row samples
    nothing) and its logprob, and the prompt logprobs by row."""

    tokens: list[int]
    logprobs: list[TokenLogprob | None]
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
