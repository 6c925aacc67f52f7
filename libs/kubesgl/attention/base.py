"""The attention backend interface: plan once per batch, then run once per layer.

A backend turns a batch's layout (lengths and page table) into whatever its kernels need in
`plan` (FlashInfer's plan(), Triton's index arrays, FA3's cu_seqlens), then `forward` is called by every
attention layer with that layer's q. The layer has already written the batch's new K/V to the cache (on CUDA
in the same kernel that normalises and rotates q and k), so backends only read the cache.
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
        layer: int,
        kv: KVCache,
        scale: float,
    ) -> torch.Tensor:  # [T, q_heads, head_dim]
        """Attends q over each request's whole KV in layer `layer` of `kv` (causal within the batch); the
        batch's own K/V are already in the cache."""
        ...
