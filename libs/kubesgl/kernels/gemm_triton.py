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
multiprocessor streaming, so K is cut into SPLIT_K ranges. Each program writes its float32 partial tile, then counts
itself done on the tile's counter (block barrier, then one acq_rel atomic at GPU scope: CUTLASS's semaphore); the
program that finds itself last sums the SPLIT_K partials in split order (a fixed order: the output is the same run
to run whichever program finishes last), writes the output, and sets the counter back to 0 for the next launch and
graph replay. No reduce kernel, no atomics on the data.

SILU: w is [gate; up] ([2N, K]); a program holds the same columns of both halves and writes silu(gate) * up, each
rounded to the output dtype first as the GEMM and `silu_and_mul` kernels round (SPLIT_K 1 only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.gemm_config import GemmConfig
from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait

# Tile counters for split-K: zeros, left zeroed by every launch. One buffer per (device, stream), so launches on
# two streams at once (two half-batches, say) never count on each other's tiles; launches on one stream run one
# after another and share it. Allocated once per stream and never replaced, since captured CUDA graphs hold their
# address (a buffer first made during a capture comes from the graph's pool, zeroed by a node of that graph).
MAX_TILES = 1 << 14
_counters: dict[tuple[torch.device, int], torch.Tensor] = {}


@triton.jit
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    stride_x,
    stride_w,
    stride_out,
    stride_part,
    SILU: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_n = offs_n < N
    mask_m = offs_m < M
    k_span = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_span
    k_hi = tl.minimum(K, k_lo + k_span)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_w
    x_cols = x_ptr + offs_m[None, :].to(tl.int64) * stride_x
    # The first weight tile before the wait: it does not depend on the kernel before this one.
    kk = k_lo + offs_k
    w_mask = mask_n[:, None] & (kk[None, :] < k_hi)
    w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
    if SILU:
        w_up = tl.load(w_rows + N.to(tl.int64) * stride_w + kk[None, :], mask=w_mask, other=0.0)
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    xt = tl.load(x_cols + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < k_hi), other=0.0)
    acc = tl.dot(w, xt)
    if SILU:
        acc_up = tl.dot(w_up, xt)
    for k in range(k_lo + BLOCK_K, k_hi, BLOCK_K):
        kk = k + offs_k
        w_mask = mask_n[:, None] & (kk[None, :] < k_hi)
        xt = tl.load(x_cols + kk[:, None], mask=mask_m[None, :] & (kk[:, None] < k_hi), other=0.0)
        w = tl.load(w_rows + kk[None, :], mask=w_mask, other=0.0)
        acc = tl.dot(w, xt, acc)
        if SILU:
            w_up = tl.load(w_rows + N.to(tl.int64) * stride_w + kk[None, :], mask=w_mask, other=0.0)
            acc_up = tl.dot(w_up, xt, acc_up)
    out_ptrs = out_ptr + offs_m[None, :].to(tl.int64) * stride_out + offs_n[:, None]
    mask_out = mask_n[:, None] & mask_m[None, :]
    dtype = out_ptr.dtype.element_ty
    if SILU:
        gate = acc.to(dtype).to(tl.float32)
        up = acc_up.to(dtype).to(tl.float32)
        tl.store(out_ptrs, (gate / (1.0 + tl.exp(-gate)) * up).to(dtype), mask=mask_out)
    elif SPLIT_K == 1:
        tl.store(out_ptrs, acc.to(dtype), mask=mask_out)
    else:
        # Partials [SPLIT_K, M, N] float32; this program's at its split index.
        tile_ofs = offs_m[None, :].to(tl.int64) * N + offs_n[:, None]
        tl.store(part_ptr + pid_k * stride_part + tile_ofs, acc, mask=mask_out)
        tl.debug_barrier()  # every thread's partial stores before the counter's release
        counter = count_ptr + pid_m * tl.num_programs(0) + pid_n
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == SPLIT_K - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero for the next launch and replay
            total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in tl.static_range(SPLIT_K):  # split order, whichever program came last
                part = part_ptr + s * stride_part + tile_ofs
                total += tl.load(part, mask=mask_out, other=0.0, cache_modifier=".cg")
            tl.store(out_ptrs, total.to(dtype), mask=mask_out)


def _counters_for(device: torch.device) -> torch.Tensor:
    key = (device, torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0)
    counters = _counters.get(key)
    if counters is None:
        counters = _counters[key] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return counters


def grid(m: int, n: int, cfg: GemmConfig) -> tuple[int, int, int]:
    return (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), cfg.split_k)


def skinny_gemm(x: torch.Tensor, w: torch.Tensor, cfg: GemmConfig, *, silu: bool = False) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T -> [M, N] in x's dtype (float32 sums), or with `silu` (w = [gate; up], [2N, K])
    silu(x @ gate.T) * (x @ up.T) [M, N]. x and w dense in their last dimension, same dtype."""
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"skinny_gemm: x {tuple(x.shape)} and w {tuple(w.shape)}")
    if x.stride(-1) != 1 or w.stride(-1) != 1 or x.dtype != w.dtype:
        raise ValueError("skinny_gemm needs x and w of one dtype, dense in their last dimension")
    if silu and (w.shape[0] % 2 or cfg.split_k != 1):
        raise ValueError(f"skinny_gemm silu: w [gate; up] with an even row count and split_k 1, got {cfg}")
    m, k = x.shape
    n = w.shape[0] // 2 if silu else w.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out
    g = grid(m, n, cfg)
    if cfg.split_k > 1:
        if g[0] * g[1] > MAX_TILES:
            raise ValueError(f"skinny_gemm: {g[0] * g[1]} output tiles exceed the {MAX_TILES} counters")
        part = torch.empty((cfg.split_k, m, n), dtype=torch.float32, device=x.device)
        counters = _counters_for(x.device)
    else:
        part = counters = out  # unused
    _skinny_gemm_kernel[g](
        x,
        w,
        out,
        part,
        counters,
        m,
        n,
        k,
        x.stride(0),
        w.stride(0),
        out.stride(0),
        m * n,
        SILU=silu,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        SPLIT_K=cfg.split_k,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_kwargs(x),
    )
    return out
