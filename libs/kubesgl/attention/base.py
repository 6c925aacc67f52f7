"""The attention backend interface: plan once per batch, then run once per layer.

A backend turns a batch's layout (lengths and page table) into whatever its kernels need in
`plan` (FlashInfer's plan(), Triton's index arrays, FA3's cu_seqlens), then `forward` is called by every
attention layer with that layer's q/k/v. New K/V are written to the cache by the backend itself, so a
backend may fuse the store into its kernel.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

import torch

if TYPE_CHECKING:
    from kubesgl.kv.kv_cache import KVCache


@dataclass
class AttentionMetadata:
    """Layout of one batch of B requests, known on the host before the forward runs.

    For request i: `prefix_lens[i]` tokens already have KV in the cache, `extend_lens[i]` new tokens are
    in this batch (1 for decode), `seq_lens[i] = prefix_lens[i] + extend_lens[i]`. The KV of token j of
    request i lives in page `page_table[i, j // page_size]`, offset `j % page_size`.
    """

    mode: Literal["extend", "decode"]
    page_size: int
    seq_lens: list[int]
    extend_lens: list[int]
    prefix_lens: list[int]
    page_table: torch.Tensor  # [B, max_pages] int32 on the device; rows past a request's pages are unused
    seq_lens_dev: torch.Tensor  # [B] int32 on the device (same values as seq_lens)

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)


class AttentionBackend(Protocol):
    """One instance per model runner, shared by all layers."""

    def plan(self, meta: AttentionMetadata) -> None:
        """Prepares per-batch state; called once before the forward pass."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [T, q_heads, head_dim]
        k: torch.Tensor | None,  # [T, kv_heads, head_dim]; None: already in the cache at out_loc
        v: torch.Tensor | None,  # [T, kv_heads, head_dim]; None with k
        layer: int,
        kv: KVCache,
        out_loc: torch.Tensor,  # [T] flat KV slots for the new tokens
        scale: float,
    ) -> torch.Tensor:  # [T, q_heads, head_dim]
        """Stores k/v at out_loc, then attends q over the request's whole KV (causal within the batch)."""
        ...
