"""Triton kernel of `kernels.gemv`: y [M, N] = x [M, K] @ w [N, K]^T for a handful of rows (decode at small batch).

One program per BLOCK_N output columns holds its whole [BLOCK_N, K] slice of the weight in registers: it loads
it before `pdl_wait`, i.e. while the kernel before it in the stream (a norm, the qkv prep, attention: at batch
1 each occupies a few SMs) still runs, then waits, reads the M activation rows and reduces in float32. Each
weight byte is read by exactly one program, once, so the kernel is one pass over the weight whose latency the
previous kernel hides; cuBLAS reads the same weights at ~1.1-1.4 TB/s at M = 1 (docs/performance.md).

Two things the kernels around a projection did can run inside it:
- SILU: w is [gate; up] ([2N, K]); the program holds rows offs_n of both halves and writes silu(gate) * up.
- NORM: x is the RMSNorm's input (plus the residual, when given): every program normalises the M rows itself
  (K elements each, from L2 after the first), as `norm_triton` would, and program 0 writes x + residual, the
  residual stream the next sub-layer reads. One norm kernel and its boundary less per projection.
Every rounding happens where the separate kernels round: the norm's output and each projection to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait

_SLICE_ELEMENTS = 8192  # weight elements a program holds (64 per thread at 4 warps): its register budget


@triton.jit
def _gemv_kernel(
    x_ptr,
    res_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    eps,
    NORM: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    SILU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    # The weights first: they do not depend on the kernel before this one.
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    w = tl.load(rows, mask=mask_n[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
    if SILU:
        w_up = tl.load(rows + N.to(tl.int64) * stride_w, mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        w_up = w_up.to(tl.float32)
    if NORM:
        norm_w = tl.load(norm_w_ptr + offs_k, mask=mask_k, other=0.0)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    for m in tl.static_range(BLOCK_M):
        if m < M:
            x = tl.load(x_ptr + m * stride_x + offs_k, mask=mask_k, other=0.0)
            if NORM:
                if HAS_RESIDUAL:
                    res = tl.load(res_ptr + m * K + offs_k, mask=mask_k, other=0.0)
                    x = x.to(res.dtype) + res
                    if pid == 0:
                        tl.store(sum_ptr + m * K + offs_k, x, mask=mask_k)
                x32 = x.to(tl.float32)
                rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / K + eps)
                x = (x32 * rstd).to(x.dtype) * norm_w
            xf = x.to(tl.float32)  # x's dtype, the output's (the norm rounds into it as norm_triton does)
            y = tl.sum(w * xf[None, :], axis=1)
            if SILU:
                up = tl.sum(w_up * xf[None, :], axis=1)
                gate = y.to(out_ptr.dtype.element_ty).to(tl.float32)
                up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
                y = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(out_ptr + m * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    m, k = x.shape
    if k != w.shape[1] or m > 8:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} (at most 8 rows)")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemv needs x and w dense in their last dimension")


def _launch(
    x: torch.Tensor,
    w: torch.Tensor,
    *,
    silu: bool = False,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    _check(x, w)
    if silu and w.shape[0] % 2:
        raise ValueError(f"gemv_silu_mul: w has {w.shape[0]} rows, not [gate; up]")
    m, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    summed = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError(
                f"norm_gemv: residual {residual.dtype} {tuple(residual.shape)} must be x's, dense"
            )
        summed = torch.empty_like(residual)
    if m == 0 or n == 0:
        return out, summed
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(64, _SLICE_ELEMENTS // ((2 if silu else 1) * block_k)))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        residual if residual is not None else x,
        norm_weight if norm_weight is not None else x,
        w,
        out,
        summed if summed is not None else x,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        eps,
        NORM=norm_weight is not None,
        HAS_RESIDUAL=residual is not None,
        SILU=silu,
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **pdl_kwargs(x),
    )
    return out, summed


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 8), w [N, K] -> x @ w.T [M, N] in x's dtype, float32 sums (no bias)."""
    return _launch(x, w)[0]


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 8), w [2N, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T) [M, N] in x's dtype: the
    gate_up projection and SiluAndMul in one kernel (float32 sums; each projection rounded to x's dtype first,
    as the two-kernel path rounds)."""
    return _launch(x, w, silu=True)[0]


def norm_gemv(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    w: torch.Tensor,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (with the residual add when `residual` is given), then the projection (and SiLU·mul when `silu`):
    (projection of norm(x + residual) * norm_weight, x + residual); without a residual the second is x itself,
    as the first layer's residual stream is its embedding."""
    if norm_weight.dtype != x.dtype or norm_weight.shape != (x.shape[-1],):
        raise ValueError(
            f"norm_gemv: norm weight {norm_weight.dtype} {tuple(norm_weight.shape)} for x {x.dtype}"
        )
    out, summed = _launch(x, w, silu=silu, residual=residual, norm_weight=norm_weight, eps=eps)
    return out, summed if summed is not None else x
