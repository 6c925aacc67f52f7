"""Rotary position embedding (NeoX layout: the two halves of each head rotate together), in place.

cos/sin are precomputed in float32 for every position up to the context length, so the forward is one
gather and a few multiplies with no host work. CUDA tensors take the Triton kernel (float32 math, one
rounding); others keep HF's arithmetic in the activation dtype, so CPU results equal HF's bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from kubesgl.errors import UnsupportedModelError
from kubesgl.kernels import apply_rotary_neox
from kubesgl.kernels.dispatch import use_triton


def default_inv_freq(rotary_dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: Mapping[str, Any]) -> torch.Tensor:
    """Llama 3.1 frequency smoothing: long wavelengths slowed by `factor`, a blend in between."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Rotates q [T, q_heads * D] and k [T, kv_heads * D] in place at the tokens' absolute positions."""

    def __init__(
        self,
        head_dim: int,
        max_position: int,
        base: float,
        scaling: Mapping[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = default_inv_freq(head_dim, base)
        rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling or {})
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]  # type: ignore[index]
        elif rope_type != "default":
            raise UnsupportedModelError(
                f"rope_type {rope_type!r} is not supported (supported: default, linear, llama3)"
            )
        freqs = torch.arange(max_position, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.register_buffer("cos", freqs.cos(), persistent=False)  # [max_position, D/2] float32
        self.register_buffer("sin", freqs.sin(), persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        x1, x2 = x.view(x.shape[0], -1, self.head_dim).chunk(2, dim=-1)
        # Same arithmetic as HF: cos/sin cast to the activation dtype, then x*cos + rotate_half(x)*sin;
        # both halves are computed before either is written.
        r1, r2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
        x1.copy_(r1)
        x2.copy_(r2)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotates q [T, q_heads * D] and k [T, kv_heads * D] (rows dense, e.g. qkv slices) in place."""
        if use_triton(q):
            return apply_rotary_neox(positions, q, k, self.cos, self.sin)
        cos = self.cos[positions].to(q.dtype)[:, None, :]
        sin = self.sin[positions].to(q.dtype)[:, None, :]
        self._rotate(q, cos, sin)
        self._rotate(k, cos, sin)
        return q, k
