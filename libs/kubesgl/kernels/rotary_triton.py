"""Triton NeoX rotary: one program per token rotates all its q and k heads in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait


@triton.jit
def norm_rotate_heads(
    src,
    dst,
    w_ptr,
    cos,
    sin,
    eps,
    num_heads,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
):
    """Rotates `num_heads` dense heads at `src` into `dst` (may be `src`), after an RMSNorm per head (HF's
    arithmetic: float32, rounded, times the weight) when HAS_NORM. Also the body of qkv_prep_triton."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    at = offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(src + at, mask=mask, other=0.0)
    x2 = tl.load(src + at + HALF, mask=mask, other=0.0)
    if HAS_NORM:
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        rstd = tl.rsqrt((tl.sum(a * a, 1) + tl.sum(b * b, 1)) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(w_ptr + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
        x1 = (a * rstd).to(x1.dtype) * w1
        x2 = (b * rstd).to(x2.dtype) * w2
    f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
    tl.store(dst + at, (f1 * cos - f2 * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + at + HALF, (f2 * cos + f1 * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    stride_q,
    stride_k,
    stride_cs,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    q, k = q_ptr + row * stride_q, k_ptr + row * stride_k
    norm_rotate_heads(q, q, cos_ptr, cos, sin, 0.0, num_q_heads, HALF, BLOCK_HQ, BLOCK_D, False)
    norm_rotate_heads(k, k, cos_ptr, cos, sin, 0.0, num_k_heads, HALF, BLOCK_HK, BLOCK_D, False)


def apply_rotary_neox(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q/k may be row-strided views (e.g. slices of a fused qkv output) as long as each row is dense."""
    half = cos.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("apply_rotary_neox needs dense rows in q, k and the cos/sin tables")
    num_q_heads = q.shape[-1] // (2 * half) if q.dim() == 2 else q.shape[1]
    num_k_heads = k.shape[-1] // (2 * half) if k.dim() == 2 else k.shape[1]
    _rotary_kernel[(q.shape[0],)](
        q,
        k,
        positions,
        cos,
        sin,
        q.stride(0),
        k.stride(0),
        cos.stride(0),
        num_q_heads,
        num_k_heads,
        HALF=half,
        BLOCK_D=triton.next_power_of_2(half),
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_k_heads),
        **pdl_kwargs(q),
    )
    return q, k
