"""Gated activations of the MLP blocks (a Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from kubesgl.kernels import silu_and_mul


class SiluAndMul(nn.Module):
    """silu(x[..., :d]) * x[..., d:] for the fused [gate | up] projection output."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
