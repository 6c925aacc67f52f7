"""RMSNorm, with the residual-add fused into the call like vLLM/SGLang (a Triton kernel on CUDA)."""

from __future__ import annotations

import torch
from torch import nn

from kubesgl.kernels import fused_add_rms_norm, rms_norm
from kubesgl.layers.linear import load_full, make_param


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (matches HF's LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), load_full)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given `residual`, (norm(x + residual), x + residual) for the next sub-layer."""
        if residual is None:
            return rms_norm(x, self.weight, self.eps)
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
