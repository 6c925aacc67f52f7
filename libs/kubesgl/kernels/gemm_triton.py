"""Triton kernel of `kernels.gemv`'s mid-batch path: y [M, N] = x [M, K] @ w [N, K]^T for decode batches of
5-256 rows, on the tensor cores, launched with programmatic dependent launch.

At these batches cuBLAS runs each of a layer's projections in 5-9 µs whatever its bytes (4-12.6 MB: 1.4-4.2 µs
at copy bandwidth on an H100), 112 of them per decode step, and its launches take no PDL, so every one of them
also pays a full drain and launch after the small Triton kernel before it (docs/performance.md, issue 25).

The product is computed transposed, acc [BLOCK_N, BLOCK_M] = w tile [BLOCK_N, BLOCK_K] @ x tile^T: the weight, the
large operand, is the MMA's A operand in its own row-major layout, and a batch of 16-64 rows is the MMA's narrow
side. Grid: (N blocks, M blocks, SPLIT_K); each program loads its first weight tile before `pdl_wait`, so the
weight stream starts while the kernel before it drains.

Split-K (for the row-parallel projections, N = hidden): with N = 1024 there are too few output tiles to keep every
multiprocessor streaming, so K is cut into SPLIT_K ranges. Each program writes its float32 partial tile (both
accumulators, with SILU or PREP), then counts itself done on the tile's counter (block barrier, then one acq_rel
atomic at GPU scope: CUTLASS's semaphore); the program that finds itself last sums the SPLIT_K partials in split
order (a fixed order: the output is the same run to run whichever program finishes last), runs the epilogue, and
sets the counter back to 0 for the next launch and graph replay. No reduce kernel, no atomics on the data.

Two of the kernels around a projection can run inside it (each rounding where the separate kernel rounds):
- SILU: w is [gate; up] ([2N, K]); a program holds the same rows of both halves (two accumulators) and writes
  silu(gate) * up, each rounded to the output dtype first as the GEMM and `silu_and_mul` kernels round.
- PREP: w is the fused qkv projection ([(q_heads + 2 kv_heads) * D, K]); a program holds one head, its first
  and second halves (D/2 rows each) in two accumulators, so its epilogue is `qkv_prep_triton` for that head: the
  per-head RMSNorm of q and k, NeoX RoPE (the halves rotate into each other), q into a dense buffer, k and v
  straight into their KV-cache slots. The qkv tensor is never written; the prep kernel and its boundary go.
(The RMSNorm before a projection was folded in too, and measured slower than the norm kernel on an H100, 0.34-0.86x:
each program summed its rows' squares over all of K before its first MMA and normalised every x tile again. It was
taken out; docs/performance.md, issue 25, sixteenth session.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.gemm_config import GemmConfig
from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait
from kubesgl.kernels.qkv_prep import QkvPrep

# Tile counters for split-K: zeros, left zeroed by every launch. One buffer per (device, stream), so launches on
# two streams at once (two half-batches, say) never count on each other's tiles; launches on one stream run one
# after another and share it. Allocated once per stream and never replaced, since captured CUDA graphs hold their
# address (a buffer first made during a capture comes from the graph's pool, zeroed by a node of that graph).
MAX_TILES = 1 << 14
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


@triton.jit
def _epilogue(
    acc,
    acc2,
    out_ptr,
    offs_n,
    offs_m,
    mask_n,
    mask_m,
    stride_out,
    pos_ptr,
    loc_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    k_cache_ptr,
    v_cache_ptr,
    stride_cs,
    eps,
    num_q_heads,
    num_kv_heads,
    head,
    SILU: tl.constexpr,
    PREP: tl.constexpr,
    QK_NORM: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """acc (and acc2, the second rows' sums with SILU/PREP) [BLOCK_N, BLOCK_M] float32 -> the output."""
    dtype = out_ptr.dtype.element_ty
    mask_out = mask_n[:, None] & mask_m[None, :]
    if PREP:
        # One head: lo = its dims [0, D/2), hi = [D/2, D), rounded where the qkv GEMM's output would round.
        lo = acc.to(dtype).to(tl.float32)
        hi = acc2.to(dtype).to(tl.float32)
        d = tl.arange(0, BLOCK_N)
        head_dim = 2 * BLOCK_N
        kv_size = num_kv_heads * head_dim
        locs = tl.load(loc_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
        if head < num_q_heads + num_kv_heads:  # q or k: norm, RoPE
            if QK_NORM:
                if head < num_q_heads:
                    w1 = tl.load(qw_ptr + d)
                    w2 = tl.load(qw_ptr + BLOCK_N + d)
                else:
                    w1 = tl.load(kw_ptr + d)
                    w2 = tl.load(kw_ptr + BLOCK_N + d)
                rstd = tl.rsqrt((tl.sum(lo * lo, 0) + tl.sum(hi * hi, 0)) / head_dim + eps)[None, :]
                lo = ((lo * rstd).to(dtype) * w1[:, None]).to(tl.float32)
                hi = ((hi * rstd).to(dtype) * w2[:, None]).to(tl.float32)
            pos = tl.load(pos_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)
            at = pos[None, :] * stride_cs + d[:, None]
            cos = tl.load(cos_ptr + at, mask=mask_m[None, :], other=0.0)
            sin = tl.load(sin_ptr + at, mask=mask_m[None, :], other=0.0)
            first = lo * cos - hi * sin
            second = hi * cos + lo * sin
            if head < num_q_heads:
                dst = out_ptr + offs_m[None, :].to(tl.int64) * stride_out + head * head_dim + d[:, None]
            else:
                dst = k_cache_ptr + locs[None, :] * kv_size + (head - num_q_heads) * head_dim + d[:, None]
            tl.store(dst, first.to(dst.dtype.element_ty), mask=mask_m[None, :])
            tl.store(dst + BLOCK_N, second.to(dst.dtype.element_ty), mask=mask_m[None, :])
        else:  # v: straight into the cache
            v_head = head - num_q_heads - num_kv_heads
            dst = v_cache_ptr + locs[None, :] * kv_size + v_head * head_dim + d[:, None]
            tl.store(dst, lo.to(dst.dtype.element_ty), mask=mask_m[None, :])
            tl.store(dst + BLOCK_N, hi.to(dst.dtype.element_ty), mask=mask_m[None, :])
    else:
        out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_out + offs_n[:, None]
        if SILU:
            gate = acc.to(dtype).to(tl.float32)
            up = acc2.to(dtype).to(tl.float32)
            tl.store(out_ptrs, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=mask_out)
        else:
            tl.store(out_ptrs, acc.to(dtype), mask=mask_out)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    pos_ptr,
    loc_ptr,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    k_cache_ptr,
    v_cache_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    stride_part,
    eps,
    stride_cs,
    num_q_heads,
    num_kv_heads,
    SILU: tl.constexpr,
    PREP: tl.constexpr,
    QK_NORM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    TWO: tl.constexpr = SILU or PREP
    # N: the output's columns (SILU: [gate; up]'s half; PREP: the whole qkv width, a program per head).
    if PREP:
        offs_n = pid_n * 2 * BLOCK_N + tl.arange(0, BLOCK_N)
        second = BLOCK_N  # the head's second half: the next BLOCK_N rows of w
        part_cols = N
    elif SILU:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        second = N  # up's rows
        part_cols = 2 * N
    else:
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        second = 0
        part_cols = N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(K, k_lo + k_span)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    w2_rows = w_rows + second * stride_w
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_x
    # The first weight tile before the wait: it does not depend on the kernel before this one.
    kk = k_lo + offs_k
    w_mask = mask_n[:, None] & (kk[None, :] < k_hi)
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    if TWO:
        w2 = tl.load(w2_rows + kk[None, :], mask=w_mask, other=0.0)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    xt = tl.load(x_cols + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < k_hi), other=0.0)
    acc = tl.dot(w, xt)
    if TWO:
        acc2 = tl.dot(w2, xt)
    else:
        acc2 = acc
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k + offs_k
        w_mask = mask_n[:, None] & (kk[None, :] < k_hi)
        xt = tl.load(x_cols + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < k_hi), other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(w, xt, acc)
        if TWO:
            w2 = tl.load(w2_rows + kk[None, :], mask=w_mask, other=0.0)
            acc2 = tl.dot(w2, xt, acc2)
    if SPLIT_K == 1:
        _epilogue(
            acc, acc2, out_ptr, offs_n, offs_m, mask_n, mask_m, stride_out, pos_ptr, loc_ptr, cos_ptr, sin_ptr,
            qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, stride_cs, eps, num_q_heads, num_kv_heads, pid_n,
            SILU, PREP, QK_NORM, BLOCK_N,
        )  # fmt: skip
    else:
        # Partials [SPLIT_K, M, part_cols] float32; this program's at its split index.
        mask_out = mask_n[:, None] & mask_m[None, :]
        tile_ofs = offs_m[None, :].to(tl.int64) * part_cols + offs_n[:, None]
        tl.store(part_ptr + pid_k * stride_part + tile_ofs, acc, mask=mask_out)
        if TWO:
            tl.store(part_ptr + pid_k * stride_part + tile_ofs + second, acc2, mask=mask_out)
        tl.debug_barrier()  # every thread's partial stores before the counter's release
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch and replay
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            total2 = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whichever program came last
                part = part_ptr + s * stride_part + tile_ofs
                total += tl.load(part, mask=mask_out, other=0.0, cache_modifier=".cg")
                if TWO:
                    total2 += tl.load(part + second, mask=mask_out, other=0.0, cache_modifier=".cg")
            _epilogue(
                total, total2, out_ptr, offs_n, offs_m, mask_n, mask_m, stride_out, pos_ptr, loc_ptr, cos_ptr,
                sin_ptr, qw_ptr, kw_ptr, k_cache_ptr, v_cache_ptr, stride_cs, eps, num_q_heads, num_kv_heads,
                pid_n, SILU, PREP, QK_NORM, BLOCK_N,
            )  # fmt: skip


def _counters_for(device: torch.device) -> torch.Tensor:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counters = _counters.get(key)
    if counters is None:
        counters = _counters[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, *, silu: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (float32 sums), or with `silu` (w = [gate; up], [2N, K])
    silu(x @ gate.T) * (x @ up.T) [M, N]. x and w dense in their last dimension, same dtype."""
    return _launch(x, w, cfg, silu=silu)


def qkv_prep_gemm(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, prep: QkvPrep) -> torch.Tensor:
    """The fused qkv projection of x (the input norm's output) and `qkv_prep` in one kernel: q [M, q_heads * D];
    k and v land in their cache slots."""
    return _launch(x, w, cfg, prep=prep)


def _launch(
    x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, *, silu: bool = False, prep: QkvPrep | None = None
) -> torch.Tensor:
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and w {tuple(w.shape)}")
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        raise ValueError("skinny_gemm needs x and w of one dtype, dense in their last dimension")
    if silu and w.shape[0] % 2:
        raise ValueError(f"skinny_gemm silu: w [gate; up] needs an even row count, got {w.shape[0]}")
    m, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    if prep is not None:
        _check_prep(prep, m, n, cfg)
        out = torch.empty((m, prep.num_q_heads * 2 * cfg.block_n), dtype=x.dtype, device=x.device)
        programs_n = n // (2 * cfg.block_n)  # one per head
    else:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        programs_n = triton.cdiv(n, cfg.block_n)
    if m == 0 or n == 0:
        return out
    g = (programs_n, triton.cdiv(m, cfg.block_m), cfg.split_k)
    part_cols = 2 * n if silu else n
    if cfg.split_k > 1:
        if g[0] * g[1] > MAX_TILES:
            raise ValueError(f"skinny_gemm: {g[0] * g[1]} output tiles exceed the {MAX_TILES} counters")
        part = torch.empty((cfg.split_k, m, part_cols), dtype=torch.float32, device=x.device)
        counters = _counters_for(x.device)
    else:
        part = counters = out  # unused
    p = prep
    _skinny_gemm_kernel[g](
        x,
        w,
        out,
        part,
        counters,
        p.positions if p else x,
        p.out_loc if p else x,
        p.cos if p else x,
        p.sin if p else x,
        p.q_norm_weight if p and p.q_norm_weight is not None else x,
        p.k_norm_weight if p and p.k_norm_weight is not None else x,
        p.k_cache if p else x,
        p.v_cache if p else x,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        m * part_cols,
        p.eps if p else 0.0,
        p.cos.stride(0) if p else 0,
        p.num_q_heads if p else 0,
        p.num_kv_heads if p else 0,
        SILU=silu,
        PREP=p is not None,
        QK_NORM=p is not None and p.q_norm_weight is not None,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_kwargs(x),
    )
    return out


def prep_layout_error(prep: QkvPrep, n: int, cfg: GemmConfig) -> str | None:
    """Why `cfg` cannot run `prep` on a qkv projection of width `n` (one program per head, so block_n is half a
    head and n the heads' width), or None where it can."""
    half = prep.cos.shape[-1]
    head_dim = 2 * half
    if cfg.block_n != half:
        return f"qkv_prep_gemm: the config's block_n must be head_dim / 2 = {half}, got {cfg}"
    if n != (prep.num_q_heads + 2 * prep.num_kv_heads) * head_dim:
        return f"qkv width {n} is not ({prep.num_q_heads} + 2 * {prep.num_kv_heads}) * {head_dim}"
    return None


def _check_prep(prep: QkvPrep, m: int, n: int, cfg: GemmConfig) -> None:
    if (error := prep_layout_error(prep, n, cfg)) is not None:
        raise ValueError(error)
    if (prep.q_norm_weight is None) != (prep.k_norm_weight is None):
        raise ValueError("q and k norms come together")
    if prep.cos.stride(-1) != 1 or prep.sin.stride() != prep.cos.stride():
        raise ValueError("qkv_prep_gemm needs dense cos/sin tables of one layout")
    if prep.positions.shape[0] < m or prep.out_loc.shape[0] < m:
        raise ValueError(f"qkv_prep_gemm: {m} rows need as many positions and cache slots")
