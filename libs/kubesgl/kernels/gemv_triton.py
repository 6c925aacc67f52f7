"""Triton kernel of `kernels.gemv`: y [M, N] = x [M, K] @ w [N, K]^T for a handful of rows (decode at small batch).

One program per BLOCK_N output columns holds its whole [BLOCK_N, K] slice of the weight in registers: it loads
it before `pdl_wait`, i.e. while the kernel before it in the stream (a norm, the qkv prep, attention: at batch
1 each occupies a few SMs) still runs, then waits, reads the M activation rows and reduces in float32. Each
weight byte is read by exactly one program, once, so the kernel is one pass over the weight whose latency the
previous kernel hides; cuBLAS reads the same weights at ~1.1-1.4 TB/s at M = 1 (docs/performance.md).
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
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_k = offs_k < K
    # The weight slice first: it does not depend on the kernel before this one.
    w = tl.load(
        w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :],
        mask=mask_n[:, None] & mask_k[None, :],
        other=0.0,
    ).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    for m in tl.static_range(BLOCK_M):
        if m < M:
            x = tl.load(x_ptr + m * stride_x + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            y = tl.sum(w * x[None, :], axis=1)
            tl.store(out_ptr + m * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_silu_mul_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    # w is [gate; up], each [N, K]: the program holds rows offs_n of both, and writes silu(gate) * up.
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w + offs_k[None, :]
    w_gate = tl.load(rows, mask=mask, other=0.0).to(tl.float32)
    w_up = tl.load(rows + N.to(tl.int64) * stride_w, mask=mask, other=0.0).to(tl.float32)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    for m in tl.static_range(BLOCK_M):
        if m < M:
            x = tl.load(x_ptr + m * stride_x + offs_k, mask=offs_k < K, other=0.0).to(tl.float32)
            gate = tl.sum(w_gate * x[None, :], axis=1)
            up = tl.sum(w_up * x[None, :], axis=1)
            # Rounded as the unfused path rounds: the projection to the activation dtype, then silu * up.
            gate = gate.to(out_ptr.dtype.element_ty).to(tl.float32)
            up = up.to(out_ptr.dtype.element_ty).to(tl.float32)
            y = gate / (1.0 + tl.exp(-gate)) * up
            tl.store(out_ptr + m * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=offs_n < N)


def _check(x: torch.Tensor, w: torch.Tensor) -> None:
    m, k = x.shape
    if k != w.shape[1] or m > 8:
        raise ValueError(f"gemv: x {tuple(x.shape)} and w {tuple(w.shape)} (at most 8 rows)")
    if x.stride(-1) != 1 or w.stride(-1) != 1:
        raise ValueError("gemv needs x and w dense in their last dimension")


def gemv_silu_mul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 8), w [2N, K] = [gate; up] -> silu(x @ gate.T) * (x @ up.T) [M, N] in x's dtype: the
    gate_up projection and SiluAndMul in one kernel (float32 sums; each projection rounded to x's dtype first,
    as the two-kernel path rounds)."""
    _check(x, w)
    if w.shape[0] % 2:
        raise ValueError(f"gemv_silu_mul: w has {w.shape[0]} rows, not [gate; up]")
    m, k = x.shape
    n = w.shape[0] // 2
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(64, _SLICE_ELEMENTS // (2 * block_k)))
    _gemv_silu_mul_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **pdl_kwargs(x),
    )
    return out


def gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] (M <= 8), w [N, K] -> x @ w.T [M, N] in x's dtype, float32 sums (no bias)."""
    _check(x, w)
    m, k = x.shape
    n = w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    block_k = triton.next_power_of_2(k)
    block_n = max(1, min(64, _SLICE_ELEMENTS // block_k))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x,
        w,
        out,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        BLOCK_M=triton.next_power_of_2(m),
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
        **pdl_kwargs(x),
    )
    return out
