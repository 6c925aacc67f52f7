"""The attention layer: hands one layer's q to the batch's attention backend, which reads the paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from kubesgl.layers.forward import ForwardBatch


class Attention(nn.Module):
    """Paged attention for layer `layer_id` over this rank's heads; no parameters."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_id: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """q [T, heads*D] -> [T, heads*D], over this layer's KV cache, which already holds the batch's K/V."""
        t = q.shape[0]
        out = fb.attn.forward(q.view(t, self.num_heads, self.head_dim), self.layer_id, fb.kv, self.scale)
        return out.reshape(t, self.num_heads * self.head_dim)
