"""RMSNorm, with the residual-add fused into the call like vLLM/SGLang."""

from __future__ import annotations

import torch
from torch import nn

from kubesgl.layers.linear import load_full, make_param


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (matches HF's LlamaRMSNorm)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = make_param((size,), load_full)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); or, given `residual`, (norm(x + residual), x + residual) for the next sub-layer."""
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x
