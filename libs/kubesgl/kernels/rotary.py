"""Rotary position embedding, NeoX layout (the two halves of each head rotate together), in place.

cos/sin are the float32 tables [max_position, head_dim // 2] that `layers.rotary.RotaryEmbedding` keeps.
"""

from __future__ import annotations

import torch

from kubesgl.kernels.dispatch import use_triton


def _rotate_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    x1, x2 = x.chunk(2, dim=-1)
    x1f, x2f = x1.float(), x2.float()
    # Both halves are computed before either is written: .float() aliases a float32 input.
    r1, r2 = x1f * cos - x2f * sin, x2f * cos + x1f * sin
    x1.copy_(r1)
    x2.copy_(r2)


def apply_rotary_neox_torch(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    head_dim = 2 * cos.shape[-1]
    c, s = cos[positions][:, None, :], sin[positions][:, None, :]
    _rotate_torch(q.view(q.shape[0], -1, head_dim), c, s)
    _rotate_torch(k.view(k.shape[0], -1, head_dim), c, s)
    return q, k


def apply_rotary_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, q_heads * D] and k [T, kv_heads * D] in place at `positions` [T]; returns them.

    The rotation is computed in float32 and rounded once to the activation dtype.
    """
    if use_triton(q):
        from kubesgl.kernels import rotary_triton

        return rotary_triton.apply_rotary_neox(positions, q, k, cos, sin)
    return apply_rotary_neox_torch(positions, q, k, cos, sin)
