"""Triton fused MoE in the style of SGLang's fused_moe_triton, kept small.

1. `align_to_experts` sorts the T*K (token, expert) assignments by expert and pads each expert's run to
   a multiple of BLOCK_M, so every BLOCK_M-row tile of the sorted list belongs to one expert.
2. `_moe_gemm_kernel` multiplies each tile's gathered rows by that expert's weight (a grouped GEMM):
   first x @ w13^T into [T*K, 2I], then (after SiLU-and-mul) act @ w2^T scaled by the routing weight.
3. The K expert outputs of each token are summed.
Everything stays on the device: the tile count is an upper bound, and tiles past the end exit early.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.activation_triton import silu_and_mul


def align_to_experts(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (sorted_ids [P], tile_expert [P // block_m]).

    sorted_ids lists assignment indices (t * K + k) grouped by expert, each group padded with the
    sentinel T*K to a multiple of block_m; tile_expert[i] is tile i's expert, or num_experts past the end.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    n = flat.numel()
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # bincount would sync to size its output
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    expert_sorted = flat[order]
    rank_in_expert = torch.arange(n, device=flat.device) - (torch.cumsum(counts, 0) - counts)[expert_sorted]
    dest = (padded_end - padded)[expert_sorted] + rank_in_expert

    capacity = n + num_experts * (block_m - 1)
    capacity = triton.cdiv(capacity, block_m) * block_m
    sorted_ids = torch.full((capacity,), n, dtype=torch.int32, device=flat.device)
    sorted_ids[dest] = order.to(torch.int32)
    tile_start = torch.arange(0, capacity, block_m, device=flat.device)
    tile_expert = torch.searchsorted(padded_end, tile_start, right=True).to(torch.int32)
    return sorted_ids, tile_expert


@triton.jit
def _moe_gemm_kernel(
    a_ptr,
    b_ptr,
    c_ptr,
    sorted_ids_ptr,
    tile_expert_ptr,
    weights_ptr,
    num_assignments,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROWS_PER_TOKEN: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """C[id] = A[id // A_ROWS_PER_TOKEN] @ B[expert]^T (x weight[id]) for the BLOCK_M ids of one tile."""
    tile = tl.program_id(0)
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    if expert < NUM_EXPERTS:
        ids = tl.load(sorted_ids_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = ids < num_assignments
        a_rows = (ids // A_ROWS_PER_TOKEN).to(tl.int64)
        offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + offs_k[None, :]
        b_ptrs = b_ptr + expert * stride_be + offs_n[None, :] * stride_bn + offs_k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_mask = offs_k < K - k0
            a = tl.load(a_ptrs, mask=valid[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None] & (offs_n[None, :] < N), other=0.0)
            acc = tl.dot(a, b, acc)
            a_ptrs += BLOCK_K
            b_ptrs += BLOCK_K
        if MUL_WEIGHT:
            acc = acc * tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
        c_ptrs = c_ptr + ids.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (offs_n[None, :] < N))


def _grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    sorted_ids: torch.Tensor,
    tile_expert: torch.Tensor,
    weights: torch.Tensor,
    *,
    a_rows_per_token: int,
    mul_weight: bool,
    block_m: int,
) -> None:
    num_experts, n, k = b.shape
    block_n, block_k = 64, 64 if k % 64 == 0 else 32
    grid = (tile_expert.shape[0], triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a,
        b,
        c,
        sorted_ids,
        tile_expert,
        weights,
        c.shape[0],
        n,
        k,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        c.stride(0),
        A_ROWS_PER_TOKEN=a_rows_per_token,
        MUL_WEIGHT=mul_weight,
        NUM_EXPERTS=num_experts,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=4,
    )


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    tokens, top_k = topk_ids.shape
    num_experts, two_i, hidden = w13.shape
    if x.stride(-1) != 1 or w13.stride(-1) != 1 or w2.stride(-1) != 1:
        raise ValueError("fused_moe needs x, w13 and w2 dense in their last dimension")
    assignments = tokens * top_k
    # Small batches (decode) waste less padding with short tiles.
    block_m = 16 if assignments <= 4 * num_experts else 64
    sorted_ids, tile_expert = align_to_experts(topk_ids, num_experts, block_m)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()

    gate_up = torch.empty((assignments, two_i), dtype=x.dtype, device=x.device)
    _grouped_gemm(
        x,
        w13,
        gate_up,
        sorted_ids,
        tile_expert,
        weights,
        a_rows_per_token=top_k,
        mul_weight=False,
        block_m=block_m,
    )
    act = silu_and_mul(gate_up)
    down = torch.empty((assignments, hidden), dtype=x.dtype, device=x.device)
    _grouped_gemm(
        act, w2, down, sorted_ids, tile_expert, weights, a_rows_per_token=1, mul_weight=True, block_m=block_m
    )
    return down.view(tokens, top_k, hidden).sum(dim=1)
