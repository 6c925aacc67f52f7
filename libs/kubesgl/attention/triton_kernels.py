"""Triton kernels for paged attention: split-KV decode (GQA-grouped) and extend with a cached prefix.

Both read K/V straight from the paged cache through the page table (token j of request b lives in slot
`page_table[b, j // page_size] * page_size + j % page_size`), so new tokens must be stored first.
Launch parameters depend only on shapes and the batch size, never on sequence lengths read from the
device, so a decode launch can be captured in a CUDA graph and replayed with new lengths.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait

LOG2E = 1.4426950408889634
EXTEND_BLOCK_M = 64  # new tokens per extend program


@triton.jit
def _attend_block(
    q,
    k_ptr,
    v_ptr,
    page_row_ptr,
    offs_n,
    mask_n,
    visible,
    kv_head,
    offs_d,
    mask_d,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    qk_scale,
    m_i,
    l_i,
    acc,
    PAGE_SIZE: tl.constexpr,
):
    """Online-softmax update of (m_i, l_i, acc) with the keys/values of tokens `offs_n` (gathered by page)."""
    page = tl.load(page_row_ptr + offs_n // PAGE_SIZE, mask=mask_n, other=0).to(tl.int64)
    slot = page * PAGE_SIZE + offs_n % PAGE_SIZE
    kv_mask = mask_n[:, None] & mask_d[None, :]
    k = tl.load(
        k_ptr + slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :], mask=kv_mask, other=0.0
    )
    qk = tl.dot(q, tl.trans(k)) * qk_scale  # log2 domain: qk_scale folds in log2(e)
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    v = tl.load(
        v_ptr + slot[:, None] * stride_vs + kv_head * stride_vh + offs_d[None, :], mask=kv_mask, other=0.0
    )
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_range(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    b,
    kv_head,
    start,
    end,
    qk_scale,
    stride_qb,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Request b's query heads of one kv head over its tokens [start, end): (heads, head mask, dim offsets,
    and the unnormalised online-softmax state m_i, l_i, acc). Shared by the split and planned decode kernels."""
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kv_head * GROUP + offs_h
    mask_h = offs_h < GROUP
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    )
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    row = page_table_ptr + b.to(tl.int64) * stride_pt
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, row, offs_n, mask_n, mask_n[None, :], kv_head, offs_d, mask_d,
            stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, m_i, l_i, acc, PAGE_SIZE,
        )  # fmt: skip
    return heads, mask_h, offs_d, m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    page_table_ptr,
    seq_lens_ptr,
    out_ptr,
    lse_ptr,
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
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    MIN_CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """One program: all GROUP query heads of one kv head over one contiguous slice of one request's KV.

    A request is cut into at most NUM_SPLITS slices of at least MIN_CHUNK tokens, so in a large batch only
    long requests are split (their programs no longer trail the batch) and short ones stay whole."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)

    seq_len = tl.load(seq_lens_ptr + b)
    chunk = tl.maximum(tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N, MIN_CHUNK)
    start = split * chunk
    end = tl.minimum(start + chunk, seq_len)

    heads, mask_h, offs_d, m_i, l_i, acc = _decode_range(
        q_ptr, k_ptr, v_ptr, page_table_ptr, b, kv_head, start, end, qk_scale, stride_qb, stride_qh,
        stride_ks, stride_kh, stride_vs, stride_vh, stride_pt, GROUP, BLOCK_H, HEAD_DIM, BLOCK_D, PAGE_SIZE, BLOCK_N,
    )  # fmt: skip

    has_kv = end > start
    out = acc / tl.where(has_kv, l_i, 1.0)[:, None]
    out_ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + split * stride_os + offs_d[None, :]
    # An empty slice writes only its LSE (-inf): the merge reads no output of a slice that has none.
    width = tl.where(has_kv, HEAD_DIM, 0)
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & (offs_d[None, :] < width))
    if NUM_SPLITS > 1:
        # Natural-log LSE of this slice; an empty slice weighs nothing in the merge.
        lse = tl.where(
            has_kv, (m_i + tl.log2(tl.where(has_kv, l_i, 1.0))) / 1.4426950408889634, float("-inf")
        )
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split, lse, mask=mask_h)


@triton.jit
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    """Combines the per-split partial outputs of one (request, head) by their log-sum-exp weights."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    mask_s = offs_s < NUM_SPLITS
    lse = tl.load(lse_ptr + b * stride_lb + h * stride_lh + offs_s, mask=mask_s, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    filled = mask_s & (lse > float("-inf"))  # empty slices left their output unwritten
    part = tl.load(
        part_ptr + b * stride_pb + h * stride_ph + offs_s[:, None] * stride_ps + offs_d[None, :],
        mask=filled[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )
    out = tl.sum(part * w[:, None], 0)
    tl.store(
        out_ptr + b * stride_ob + h * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@triton.jit
def _extend_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    page_table_ptr,
    q_start_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    tile_req_ptr,
    tile_block_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_ks,
    stride_kh,
    stride_vs,
    stride_vh,
    stride_pt,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One program: tile `tile` (BLOCK_M new tokens of one request) and one query head, over prefix + causal
    new KV. Tiles are listed on the host (`extend_tiles`), so no program is launched for rows past a request's
    new tokens: a mixed step's one-token decode rows would otherwise launch max_extend / BLOCK_M programs each."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.load(tile_req_ptr + tile)
    m_block = tl.load(tile_block_ptr + tile)
    extend_len = tl.load(extend_lens_ptr + b)
    q_start = tl.load(q_start_ptr + b)
    prefix = tl.load(prefix_lens_ptr + b)
    kv_head = h // GROUP

    offs_m = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask_m = offs_m < extend_len
    mask_d = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
        mask=mask_m[:, None] & mask_d[None, :],
        other=0.0,
    )
    # Query m sits at absolute position prefix + m and sees keys 0..prefix + m.
    q_pos = prefix + offs_m
    kv_end = prefix + tl.minimum(extend_len, (m_block + 1) * BLOCK_M)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    row = page_table_ptr + b * stride_pt
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        # Key 0 is visible to every row, so the running max is finite from the first block on.
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _attend_block(
            q, k_ptr, v_ptr, row, offs_n, mask_n, visible, kv_head, offs_d, mask_d,
            stride_ks, stride_kh, stride_vs, stride_vh, qk_scale, m_i, l_i, acc, PAGE_SIZE,
        )  # fmt: skip

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_d[None, :],
    )


def extend_tiles(prefix_lens: list[int], extend_lens: list[int], block_m: int = EXTEND_BLOCK_M) -> np.ndarray:
    """The extend kernel's work list, [2, tiles] int32: each tile's request and its block of BLOCK_M new tokens,
    the costliest first (a tile attends prefix + its last token's position keys), so long tiles start early
    and short ones fill in behind them."""
    pre = np.asarray(prefix_lens, dtype=np.int64)
    ext = np.asarray(extend_lens, dtype=np.int64)
    blocks = -(-ext // block_m)
    req = np.repeat(np.arange(len(ext)), blocks)
    block = np.arange(int(blocks.sum())) - np.repeat(np.cumsum(blocks) - blocks, blocks)
    keys = pre[req] + np.minimum(ext[req], (block + 1) * block_m)
    order = np.argsort(-keys, kind="stable")
    return np.stack([req[order], block[order]]).astype(np.int32)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seq_lens: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    partial_out: torch.Tensor | None = None,
    partial_lse: torch.Tensor | None = None,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 3,
    min_chunk: int = 0,
) -> torch.Tensor:
    """One query token per request: q/out [B, q_heads, D]; caches [num_pages, page_size, kv_heads, D].

    With `partial_out` [B, q_heads, S, D] float32 and `partial_lse` [B, q_heads, S], each request's KV is
    cut into S slices attended in parallel and merged (flash-decoding); without them S = 1. A slice is at
    least `min_chunk` tokens long (rounded up to blocks), so requests shorter than that are not cut.
    """
    batch, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_q_heads // num_kv_heads
    num_splits = 1 if partial_out is None else partial_out.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    block_d = triton.next_power_of_2(head_dim)
    if num_splits == 1:
        target, lse, stride_os = out, out, 0  # lse is never written with one split
        stride_ob, stride_oh = out.stride(0), out.stride(1)
        stride_lb = stride_lh = 0
    else:
        assert partial_lse is not None, "partial_out needs partial_lse"
        target, lse, stride_os = partial_out, partial_lse, partial_out.stride(2)
        stride_ob, stride_oh = partial_out.stride(0), partial_out.stride(1)
        stride_lb, stride_lh = partial_lse.stride(0), partial_lse.stride(1)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        k_flat,
        v_flat,
        page_table,
        seq_lens,
        target,
        lse,
        scale * LOG2E,
        q.stride(0),
        q.stride(1),
        k_flat.stride(0),
        k_flat.stride(1),
        v_flat.stride(0),
        v_flat.stride(1),
        page_table.stride(0),
        stride_ob,
        stride_oh,
        stride_os,
        stride_lb,
        stride_lh,
        GROUP=group,
        BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        PAGE_SIZE=page_size,
        BLOCK_N=block_n,
        NUM_SPLITS=num_splits,
        MIN_CHUNK=-(-min_chunk // block_n) * block_n,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_kwargs(q),
    )
    if num_splits > 1:
        _decode_merge_kernel[(batch, num_q_heads)](
            partial_out,
            partial_lse,
            out,
            partial_out.stride(0),
            partial_out.stride(1),
            partial_out.stride(2),
            partial_lse.stride(0),
            partial_lse.stride(1),
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            NUM_SPLITS=num_splits,
            BLOCK_S=triton.next_power_of_2(num_splits),
            **pdl_kwargs(q),
        )
    return out


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    q_starts: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    tiles: torch.Tensor,
    out: torch.Tensor,
    scale: float,
    *,
    block_n: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """New tokens of B requests, flattened: q/out [T, q_heads, D]; request b's rows start at q_starts[b].
    `tiles` [2, n] int32 on the device is `extend_tiles` of the batch's lengths (blocks of EXTEND_BLOCK_M)."""
    _, num_q_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    grid = (tiles.shape[1], num_q_heads)
    _extend_kernel[grid](
        q,
        k_flat,
        v_flat,
        out,
        page_table,
        q_starts,
        prefix_lens,
        extend_lens,
        tiles[0],
        tiles[1],
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
        GROUP=num_q_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE_SIZE=page_size,
        BLOCK_M=EXTEND_BLOCK_M,
        BLOCK_N=block_n,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out
