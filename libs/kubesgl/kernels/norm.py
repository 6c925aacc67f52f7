"""RMSNorm with an optional fused residual add: `rms_norm` and `fused_add_rms_norm`.

Arithmetic follows HF's Qwen/Llama RMSNorm: normalize in float32, cast to the input dtype, then scale
by the weight in that dtype.
"""

from __future__ import annotations

import torch

from kubesgl.kernels.dispatch import use_triton


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., hidden] -> norm(x) * weight."""
    if use_triton(x):
        from kubesgl.kernels import norm_triton

        return norm_triton.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (norm(x + residual) * weight, x + residual): the residual stream for the next sub-layer.

    The sum is in residual's dtype: a float32 x (the fused MLP's output) is rounded to it before the add."""
    if use_triton(x):
        from kubesgl.kernels import norm_triton

        return norm_triton.fused_add_rms_norm(x, residual, weight, eps)
    summed = x.to(residual.dtype) + residual
    return rms_norm_torch(summed, weight, eps), summed
