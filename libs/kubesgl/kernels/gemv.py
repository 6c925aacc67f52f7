"""Projections of a handful of rows (decode at batch <= GEMV_MAX_ROWS) as one Triton GEMV kernel on CUDA.

At batch 1 the decode step's four projections per layer run as cuBLAS GEMMs at ~1.1-1.4 TB/s, with several
microseconds of fixed cost each beyond their bytes, and cuBLAS's launches take no programmatic dependent launch
(docs/performance.md, issue 25). `gemv_triton` holds each program's weight slice in registers, loaded before
it waits on the previous kernel, so the weight stream starts while a small norm or attention kernel still runs.
`gate_up_silu` also folds a dense MLP's SiLU·mul into its gate_up GEMV (one kernel and one boundary less per layer),
and `norm_linear` the RMSNorm before a projection (the decoder's input norm before qkv, its residual norm
before gate_up: two more per layer).
On by default on CUDA (measured: on an H100 the batch-1 decode step went 1.483 -> 1.109 ms with the GEMV, 1.073
with the SiLU fold; with the norm folds 1.107 -> 1.030 on another H100 and 0.956 -> 0.881 on an H200; offline
throughput unchanged; docs/performance.md). KUBESGL_GEMV=0 keeps cuBLAS and SiluAndMul; KUBESGL_GEMV_SILU=0 and
KUBESGL_GEMV_NORM=0 turn off only their fold. Each program's sums run in a fixed order (no atomics: run to run
identical), another order than cuBLAS's: outputs differ from it within the dtype's rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubesgl import env
from kubesgl.kernels.dispatch import use_triton

GEMV_MAX_ROWS = 4
GEMV_MAX_K = 4096  # a program holds [N/programs, K] in registers; larger K keeps cuBLAS


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the Triton GEMV for x [M, K] and weight [N, K] (switch on, CUDA, M and K small)."""
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and env.gemv()
        and weight.shape[1] <= GEMV_MAX_K
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and use_triton(x)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the GEMV kernel where `gemv_applies` (and there is no bias)."""
    if bias is None and gemv_applies(x, weight):
        from kubesgl.kernels import gemv_triton

        return gemv_triton.gemv(x, weight)
    return F.linear(x, weight, bias)


def gate_up_silu(
    x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) for gate_up = [gate; up] [2I, K] as one GEMV kernel where `gemv_applies`,
    there is no bias and KUBESGL_GEMV_SILU is on; None otherwise (the caller runs the projection and SiluAndMul)."""
    if bias is not None or not (gemv_applies(x, gate_up) and env.gemv_silu()):
        return None
    from kubesgl.kernels import gemv_triton

    return gemv_triton.gemv_silu_mul(x, gate_up)


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An RMSNorm (with its residual add) and the projection after it as one GEMV kernel: (projection, or
    silu·mul of [gate; up] when `silu`, of norm(x + residual), x + residual) where `gemv_applies`, there is no
    bias, x has the norm weight's dtype, the residual (if any) is dense and x's dtype and shape, and the norm
    fold (and for `silu` the SiLU fold) is on; None otherwise (the caller runs the norm and the projection). A
    float32 x is the fused MLP's sum, which the separate norm rounds into the residual's dtype first."""
    if bias is not None or not (
        gemv_applies(x, weight) and env.gemv_norm() and (env.gemv_silu() or not silu)
    ):
        return None
    if x.dtype != norm_weight.dtype:
        return None
    if residual is not None and (
        residual.dtype != x.dtype or residual.shape != x.shape or not residual.is_contiguous()
    ):
        return None
    from kubesgl.kernels import gemv_triton

    return gemv_triton.norm_gemv(x, residual, norm_weight, eps, weight, silu=silu)
