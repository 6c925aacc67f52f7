"""Fused mixture-of-experts: `fused_moe` and its plain-torch reference `experts_forward` (one signature,
`ExpertsForward`).

On CUDA `fused_moe` runs the Triton grouped GEMMs (no host sync, one launch per projection); elsewhere it is
`experts_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from kubesgl.kernels.dispatch import use_triton

ExpertsForward = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


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
    return experts_forward(x, w13, w2, topk_weights, topk_ids)


def experts_forward(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """sum_k weight_k * expert_{id_k}(x) with tokens grouped by expert (one matmul pair per hit expert).

    Reference kernel: reading the per-expert counts syncs with the host, which `fused_moe` avoids on CUDA.
    """
    t, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)
    token_of = order // k
    counts = torch.bincount(flat_ids, minlength=w13.shape[0]).tolist()
    weights = topk_weights.reshape(-1)[order].to(x.dtype)
    out = torch.zeros_like(x)
    start = 0
    for expert, n in enumerate(counts):
        if n == 0:
            continue
        rows = token_of[start : start + n]
        gate, up = F.linear(x[rows], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights[start : start + n, None]
        out.index_add_(0, rows, y)
        start += n
    return out
