"""Triton decode attention driven by a host-planned work list (`attention/decode_plan.py`).

One program per (work item, kv head): all query heads of that kv head over one item's token range. The grid
is the plan's capacity times the kv heads, fixed per batch size, so a CUDA graph replays any plan of that
size; slack items (request -1) return at once. Programs are numbered item-major, so the kv heads of an item
start together and items start in the plan's order (longest first). An item covering a whole request writes
the output; the parts of a cut request write float32 partials and their log-sum-exp, which the merge kernel
combines (one program per request and query head; requests that were not cut return at once).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.attention.decode_plan import ITEM_INTS, MERGE_INTS
from kubesgl.attention.triton_kernels import LOG2E, _decode_range
from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait


@triton.jit
def _planned_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    work_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ob,
    stride_oh,
    stride_pp,
    stride_ph,
    stride_lp,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ITEM: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid = tl.program_id(0)
    item = pid // NUM_KV_HEADS
    kv_head = pid % NUM_KV_HEADS
    # Slack items wait too: the grid must not count as finished before the kernel it depends on.
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    b = tl.load(work_ptr + item * ITEM)
    if b >= 0:
        start = tl.load(work_ptr + item * ITEM + 1)
        end = tl.load(work_ptr + item * ITEM + 2)
        slot = tl.load(work_ptr + item * ITEM + 3)
        heads, mask_h, offs_d, m_i, l_i, acc = _decode_range(
            q_ptr, k_ptr, v_ptr, page_table_ptr, b, kv_head, start, end, qk_scale, stride_qb, stride_qh,
            stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, PAGE_SIZE,
            BLOCK_N,
        )  # fmt: skip
        mask_hd = mask_h[:, None] & (offs_d[None, :] < HEAD_DIM)
        out = acc / l_i[:, None]  # every item holds at least one token
        if slot < 0:
            tl.store(
                out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=mask_hd,
            )
        else:
            slot64 = slot.to(tl.int64)
            tl.store(
                part_out_ptr + slot64 * stride_pp + heads[:, None] * stride_ph + offs_d[None, :],
                out,
                mask=mask_hd,
            )
            lse = (m_i + tl.log2(l_i)) / 1.4426950408889634  # natural-log LSE of this part
            tl.store(part_lse_ptr + slot64 * stride_lp + heads, lse, mask=mask_h)


@triton.jit
def _planned_merge_kernel(
    merge_ptr,
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    stride_pp,
    stride_ph,
    stride_lp,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MERGE: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Log-sum-exp merge of one cut request's parts for one query head (online, any number of parts)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    first = tl.load(merge_ptr + b * MERGE)
    count = tl.load(merge_ptr + b * MERGE + 1)
    if count > 0:
        offs_d = tl.arange(0, BLOCK_D)
        mask_d = offs_d < HEAD_DIM
        m = float("-inf")
        denom = 0.0
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(0, count):
            slot = (first + i).to(tl.int64)
            lse = tl.load(part_lse_ptr + slot * stride_lp + h)
            part = tl.load(part_out_ptr + slot * stride_pp + h * stride_ph + offs_d, mask=mask_d, other=0.0)
            m_new = tl.maximum(m, lse)
            keep = tl.exp(m - m_new)
            w = tl.exp(lse - m_new)
            acc = acc * keep + w * part
            denom = denom * keep + w
            m = m_new
        tl.store(
            out_ptr + b * stride_ob + h * stride_oh + offs_d,
            (acc / denom).to(out_ptr.dtype.element_ty),
            mask=mask_d,
        )


def planned_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    work: torch.Tensor,
    capacity: int,
    out: torch.Tensor,
    scale: float,
    partial_out: torch.Tensor,
    partial_lse: torch.Tensor,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
) -> torch.Tensor:
    """q/out [B, q_heads, D]; caches [num_pages, page_size, kv_heads, D]; `work` the device copy of a
    `DecodeWork.ints` with `capacity` items (then B merge rows); partial_out [P, q_heads, D] and partial_lse
    [P, q_heads] float32 with P >= the plan's partial slots. `block_n` must be the planner's."""
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    block_d = triton.next_power_of_2(head_dim)
    _planned_decode_kernel[(capacity * num_kv_heads,)](
        q,
        k_flat,
        v_flat,
        page_table,
        work,
        out,
        partial_out,
        partial_lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        page_table.stride(0),
        out.stride(0),
        out.stride(1),
        partial_out.stride(0),
        partial_out.stride(1),
        partial_lse.stride(0),
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        ITEM=ITEM_INTS,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q),
    )
    _planned_merge_kernel[(batch, num_q_heads)](
        work[capacity * ITEM_INTS :],
        partial_out,
        partial_lse,
        out,
        partial_out.stride(0),
        partial_out.stride(1),
        partial_lse.stride(0),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        MERGE=MERGE_INTS,
        num_warps=1,
        **pdl_kwargs(q),
    )
    return out
