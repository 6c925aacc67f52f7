"""The stretch between the qkv projection and attention: q/k RMSNorm per head, RoPE, and the KV store.

On CUDA the decoder runs it as one Triton kernel (`qkv_prep_triton.qkv_prep`), or inside the qkv projection's
mid-batch GEMM (`gemm_triton.qkv_prep_gemm`), both given one layer's arguments as a `QkvPrep`; `qkv_prep_torch` is
the same contract composed from the unfused reference ops, the kernel's reference in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kubesgl.kernels.norm import rms_norm_torch
from kubesgl.kernels.rotary import apply_rotary_neox_torch


@dataclass(frozen=True)
class QkvPrep:
    """One layer's prep after the qkv projection: positions and cache slots of the rows, the RoPE tables (cos/sin
    [positions, D/2] float32), the q/k norm weights (None for a model without) and eps, the layer's K/V caches
    ([slots, kv_heads, D] with dense slot rows) and the head counts."""

    positions: torch.Tensor
    out_loc: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    q_norm_weight: torch.Tensor | None
    k_norm_weight: torch.Tensor | None
    eps: float
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    num_q_heads: int
    num_kv_heads: int

    def run(self, qkv: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`qkv_prep_triton.qkv_prep` on a qkv projection's output: q [T, q_heads, D] (into `out` when given)."""
        from kubesgl.kernels.qkv_prep_triton import qkv_prep

        p = self
        return qkv_prep(qkv, p.positions, p.out_loc, p.cos, p.sin, p.q_norm_weight, p.k_norm_weight, p.eps,
                        p.k_cache, p.v_cache, p.num_q_heads, p.num_kv_heads, out)  # fmt: skip


def qkv_prep_torch(
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
) -> torch.Tensor:
    head_dim = 2 * cos.shape[-1]
    t = qkv.shape[0]
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.reshape(t, num_q_heads, head_dim).clone()
    k = k.reshape(t, num_kv_heads, head_dim).clone()
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = rms_norm_torch(q, q_norm_weight, eps), rms_norm_torch(k, k_norm_weight, eps)
    apply_rotary_neox_torch(positions, q, k, cos, sin)
    k_cache.view(-1, num_kv_heads, head_dim)[out_loc] = k.to(k_cache.dtype)
    v_cache.view(-1, num_kv_heads, head_dim)[out_loc] = v.reshape(t, num_kv_heads, head_dim).to(v_cache.dtype)
    return q
