"""One Triton kernel between the qkv projection and attention: per-head q/k RMSNorm, NeoX RoPE, KV store.

Unfused, that stretch of a layer is seven or eight launches (q and k copies out of the fused qkv row, two
norms, RoPE, the K and V scatters, a copy of v); at decode batch sizes each is a few microseconds of almost
no work, and 28 layers of them were most of a small batch's step. Here one program per token reads its qkv
row once, writes q (normed, rotated) to a dense [T, q_heads, head_dim] buffer for the attention kernel, and
k (normed, rotated) and v straight into their KV-cache slot.

Arithmetic equals the unfused Triton path: the norm is computed in float32, rounded to the activation dtype
and scaled by the weight in that dtype (HF's RMSNorm), then RoPE runs in float32 and rounds once.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait
from kubesgl.kernels.rotary_triton import norm_rotate_heads


@triton.jit
def _qkv_prep_kernel(
    qkv_ptr,
    pos_ptr,
    loc_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    q_out_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_qkv,
    stride_cs,
    eps,
    num_q_heads,
    num_kv_heads,
    HALF: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    HAS_NORM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    # positions and slots are written by the step's input kernels, the qkv row by the projection.
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    loc = tl.load(loc_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    cos = tl.load(cos_ptr + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    sin = tl.load(sin_ptr + pos * stride_cs + offs_d, mask=offs_d < HALF, other=0.0)[None, :]
    head = 2 * HALF
    row = qkv_ptr + t * stride_qkv
    q_size, kv_size = num_q_heads * head, num_kv_heads * head
    norm_rotate_heads(
        row, q_out_ptr + t * q_size, qw_ptr, cos, sin, eps, num_q_heads, HALF, BLOCK_HQ, BLOCK_D, HAS_NORM
    )
    norm_rotate_heads(
        row + q_size,
        k_cache_ptr + loc * kv_size,
        kw_ptr,
        cos,
        sin,
        eps,
        num_kv_heads,
        HALF,
        BLOCK_HK,
        BLOCK_D,
        HAS_NORM,
    )
    offs_v = tl.arange(0, BLOCK_HK * 2 * BLOCK_D)
    v = tl.load(row + q_size + kv_size + offs_v, mask=offs_v < kv_size, other=0.0)
    tl.store(v_cache_ptr + loc * kv_size + offs_v, v.to(v_cache_ptr.dtype.element_ty), mask=offs_v < kv_size)


def qkv_prep(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    out_loc: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_norm_weight: torch.Tensor | None,
    k_norm_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """qkv [T, (q_heads + 2 * kv_heads) * D] -> q [T, q_heads, D]; k and v land in cache slots `out_loc`.

    k_cache/v_cache: one layer's [slots, kv_heads, D] (any leading layout with dense slot rows). `out`: a dense
    [T, q_heads * D] tensor (e.g. a graph's static buffer) that q is written into and returned as, viewed.
    """
    half = cos.shape[-1]
    head_dim = 2 * half
    t = qkv.shape[0]
    if qkv.stride(-1) != 1 or cos.stride(-1) != 1:
        raise ValueError("qkv_prep needs dense qkv rows and cos/sin tables")
    if qkv.shape[-1] != (num_q_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(
            f"qkv width {qkv.shape[-1]} is not ({num_q_heads} + 2 * {num_kv_heads}) * {head_dim}"
        )
    has_norm = q_norm_weight is not None
    if has_norm != (k_norm_weight is not None):
        raise ValueError("q and k norms come together")
    if out is None:
        q = torch.empty((t, num_q_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    elif (
        out.shape[0] != t
        or out.numel() != t * num_q_heads * head_dim
        or not out.is_contiguous()
        or out.dtype != qkv.dtype
    ):
        raise ValueError(
            f"out must be a dense [{t}, {num_q_heads * head_dim}] tensor, got {tuple(out.shape)}"
        )
    else:
        q = out.view(t, num_q_heads, head_dim)
    if t == 0:
        return q
    block_d = triton.next_power_of_2(half)
    _qkv_prep_kernel[(t,)](
        qkv,
        positions,
        out_loc,
        cos,
        sin,
        q_norm_weight if has_norm else cos,
        k_norm_weight if has_norm else cos,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos.stride(0),
        eps,
        num_q_heads,
        num_kv_heads,
        HALF=half,
        BLOCK_D=block_d,
        BLOCK_HQ=triton.next_power_of_2(num_q_heads),
        BLOCK_HK=triton.next_power_of_2(num_kv_heads),
        HAS_NORM=has_norm,
        num_warps=4,
        **pdl_kwargs(qkv),
    )
    return q
