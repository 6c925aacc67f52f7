"""SiLU-gated MLP activation: silu(x[..., :d]) * x[..., d:] for the fused [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubesgl.kernels.dispatch import use_triton


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2d] -> [..., d]."""
    if use_triton(x):
        from kubesgl.kernels import activation_triton

        return activation_triton.silu_and_mul(x)
    return silu_and_mul_torch(x)
