"""Triton kernel of `kernels.fused_mlp`: one program per BLOCK_I-wide slice of the intermediate dim.

A program streams its slice's gate and up rows (w_gate_up [2I, H]) against the batch's rows, rounds both to the
activation dtype (as the unfused GEMM's output is), applies SiLU·mul in float32 and rounds again (as the
unfused kernel does), then multiplies by its columns of w_down [H, I] and atomically adds the [M, H] float32
share into the output. Every weight byte is read by exactly one program, so the kernel is one pass over the
MLP's weights spread over I / BLOCK_I programs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait


@triton.jit
def _fused_mlp_kernel(
    x_ptr,
    wgu_ptr,
    wd_ptr,
    out_ptr,
    M,
    H,
    INTER,
    stride_x,
    stride_wgu,
    stride_wd,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_I: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_H: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    offs_i = tl.program_id(0) * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < INTER
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    offs_k = tl.arange(0, BLOCK_K)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    gate = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    up = tl.zeros([BLOCK_M, BLOCK_I], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        mask_k = offs_k < H - k0
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_x + k0 + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        w_at = wgu_ptr + offs_i[None, :].to(tl.int64) * stride_wgu + k0 + offs_k[:, None]
        w_mask = mask_k[:, None] & mask_i[None, :]
        gate = tl.dot(x, tl.load(w_at, mask=w_mask, other=0.0), gate)
        up = tl.dot(x, tl.load(w_at + INTER * stride_wgu, mask=w_mask, other=0.0), up)
    dtype = x_ptr.dtype.element_ty
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g)) * u).to(dtype)
    offs_h = tl.arange(0, BLOCK_H)
    for h0 in range(0, H, BLOCK_H):
        mask_h = offs_h < H - h0
        wd = tl.load(
            wd_ptr + (h0 + offs_h[None, :]).to(tl.int64) * stride_wd + offs_i[:, None],
            mask=mask_i[:, None] & mask_h[None, :],
            other=0.0,
        )
        share = tl.dot(act, wd)
        tl.atomic_add(
            out_ptr + offs_m[:, None] * stride_out + h0 + offs_h[None, :],
            share,
            mask=mask_m[:, None] & mask_h[None, :],
            sem="relaxed",
        )


def fused_mlp(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *, block_i: int = 16
) -> torch.Tensor:
    m, hidden = x.shape
    two_i, k = w_gate_up.shape
    inter = two_i // 2
    if k != hidden or tuple(w_down.shape) != (hidden, inter):
        raise ValueError(
            f"fused_mlp: x {tuple(x.shape)}, gate_up {tuple(w_gate_up.shape)}, down {tuple(w_down.shape)}"
        )
    if x.stride(-1) != 1 or w_gate_up.stride(-1) != 1 or w_down.stride(-1) != 1:
        raise ValueError("fused_mlp needs x and both weights dense in their last dimension")
    out = torch.zeros((m, hidden), dtype=torch.float32, device=x.device)
    if m == 0:
        return out
    _fused_mlp_kernel[(triton.cdiv(inter, block_i),)](
        x,
        w_gate_up,
        w_down,
        out,
        m,
        hidden,
        inter,
        x.stride(0),
        w_gate_up.stride(0),
        w_down.stride(0),
        out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)),
        BLOCK_I=block_i,
        BLOCK_K=128,
        BLOCK_H=128,
        num_warps=4,
        **pdl_kwargs(x),
    )
    return out
