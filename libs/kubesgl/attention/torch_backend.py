"""Reference attention in plain PyTorch: any device, any page size, one request at a time."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kubesgl.attention.base import AttentionMetadata

if TYPE_CHECKING:
    from kubesgl.kv.kv_cache import KVCache


class TorchAttention:
    """Gathers each request's KV through its page table and runs SDPA; slow, obviously correct."""

    name = "torch"

    def __init__(self) -> None:
        self._meta: AttentionMetadata | None = None
        self._slots: list[torch.Tensor] = []

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        p = meta.page_size
        self._slots = []
        for i, n in enumerate(meta.seq_lens):
            pos = torch.arange(n, device=meta.page_table.device)
            pages = meta.page_table[i, pos // p].long()
            self._slots.append(pages * p + pos % p)

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        kv: KVCache,
        scale: float,
    ) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() must run before forward()"
        k_all, v_all = kv.k_flat(layer), kv.v_flat(layer)
        group = q.shape[1] // kv.num_kv_heads
        out = torch.empty_like(q)
        start = 0
        for i, slots in enumerate(self._slots):
            n_new, n_prefix = meta.extend_lens[i], meta.prefix_lens[i]
            qi = q[start : start + n_new].transpose(0, 1)  # [H, n_new, D]
            ki = k_all[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            vi = v_all[slots].to(q.dtype).transpose(0, 1).repeat_interleave(group, dim=0)
            # Query j (absolute position n_prefix + j) sees keys 0..n_prefix + j.
            mask = torch.ones(n_new, n_new + n_prefix, dtype=torch.bool, device=q.device).tril(n_prefix)
            oi = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale)
            out[start : start + n_new] = oi.transpose(0, 1)
            start += n_new
        return out
