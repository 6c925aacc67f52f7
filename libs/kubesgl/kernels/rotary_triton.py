"""Triton NeoX rotary: one program per token rotates all its q and k heads in place."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(x_ptr, row, stride_row, cos, sin, num_heads, offs_h, offs_d, HALF: tl.constexpr):
    mask = (offs_h[:, None] < num_heads) & (offs_d[None, :] < HALF)
    ptrs = x_ptr + row * stride_row + offs_h[:, None] * (2 * HALF) + offs_d[None, :]
    x1 = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(ptrs, (x1 * cos - x2 * sin).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(ptrs + HALF, (x2 * cos + x1 * sin).to(x_ptr.dtype.element_ty), mask=mask)


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
):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + row).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    _rotate_heads(q_ptr, row, stride_q, cos, sin, num_q_heads, tl.arange(0, BLOCK_HQ), offs_d, HALF)
    _rotate_heads(k_ptr, row, stride_k, cos, sin, num_k_heads, tl.arange(0, BLOCK_HK), offs_d, HALF)


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
    )
    return q, k
