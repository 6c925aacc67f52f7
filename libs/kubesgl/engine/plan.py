"""BatchPlan: everything a rank needs to run one step, decided on rank 0 and broadcast to the others."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

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


@dataclass
class BatchPlan:
    """One forward + sample step over B requests (see AttentionMetadata for the length fields)."""

    mode: Literal["extend", "decode"]
    slots: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    tokens: list[int]  # extend: the new tokens, concatenated; decode: empty (read from the token pool)
    sample: list[bool]  # False for a prefill chunk that is not the request's last
    top_logprobs: list[int]  # per request: -1 no logprobs, else how many alternatives
    page_writes: list[tuple[int, int, list[int]]] = field(default_factory=list)  # (slot, first index, pages)
    slot_inits: list[SlotInit] = field(default_factory=list)

    @property
    def batch_size(self) -> int:
        return len(self.slots)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]
