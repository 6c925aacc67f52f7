"""Fused mixture-of-experts: `fused_moe` has the signature of `layers.moe.experts_forward`.

On CUDA it runs the Triton grouped GEMMs (no host sync, one launch per projection); elsewhere it is
the plain-torch `experts_forward`.
"""

from __future__ import annotations

import torch

from kubesgl.kernels.dispatch import use_triton


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k topk_weights[:, k] * expert_{topk_ids[:, k]}(x) with SiLU-gated experts.

    x [T, H]; w13 [E, 2I, H] (each expert's [gate | up]); w2 [E, H, I]; topk_* [T, K].
    """
    if use_triton(x):
        from kubesgl.kernels import fused_moe_triton

        return fused_moe_triton.fused_moe(x, w13, w2, topk_weights, topk_ids)
    from kubesgl.layers.moe import experts_forward

    return experts_forward(x, w13, w2, topk_weights, topk_ids)
