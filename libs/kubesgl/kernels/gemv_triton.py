"""Small-batch linear layers in Triton: y = prologue(x) @ W^T for decode batches, reading W once.

At decode batch sizes a projection is a weight read: Qwen3-0.6B's four projections are 31.5 MB per layer
against a few KB of activations, and cuBLAS read them at ~1.1 TB/s on the H200 (28 us a layer at bs 1, about
the same at bs 256, where its large tiles leave most of the 132 multiprocessors idle on N = 1024-6144).
Here each program owns a BLOCK_N-column stripe of W over one K-slice (split-K), so a skinny projection
still spreads over a few waves of programs; the tensor cores multiply the [BLOCK_M, BLOCK_K] activation
tile (rows past M masked) by the [BLOCK_K, BLOCK_N] weight tile.

Split-K without a second launch: each program stores its float32 partial tile, and the last program of a
tile to arrive (a counter per tile, taken with an acq_rel atomic after a CTA barrier, the way CUTLASS's
serial split-K semaphore publishes) sums the partials, applies the epilogue and resets the counter, so the
next launch (or CUDA-graph replay) finds it at zero.

Fused prologues, which remove a launch and an activation round trip each:
- RMSNORM: y = rmsnorm(x [+ residual]) @ W^T; the sum x + residual is written once (by the column-0
  programs) as the next residual. The norm is factored out of the product: sum_k s_k w_k W_nk * rstd, with
  s the bf16 sum, w the norm weight and rstd from s's float32 square sum (accumulated per K-slice, combined
  in the epilogue), so no program needs the whole row before it starts.
- SILU_MUL: y = (silu(gate) * up) @ W^T for x = [gate | up] (the down projection of a SwiGLU MLP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
import triton.testing

PROLOGUE_NONE, PROLOGUE_RMSNORM, PROLOGUE_SILU_MUL = 0, 1, 2


@triton.jit
def _activation_tile(
    x_ptr,
    res_ptr,
    res_out_ptr,
    nw_ptr,
    offs_m,
    offs_k,
    mask_m,
    mask_k,
    stride_xm,
    stride_rm,
    stride_rom,
    K,
    pid_n,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    W_DTYPE: tl.constexpr,
):
    """The [BLOCK_M, BLOCK_K] input tile after the prologue, in the weight dtype, and its rows' square sums."""
    mask = mask_m[:, None] & mask_k[None, :]
    rows = offs_m[:, None].to(tl.int64)
    if PROLOGUE == 2:
        gate = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + rows * stride_xm + K + offs_k[None, :], mask=mask, other=0.0).to(tl.float32)
        a = (gate / (1.0 + tl.exp(-gate)) * up).to(W_DTYPE)
        sq = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
    else:
        a = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask, other=0.0)
        if PROLOGUE == 1:
            if HAS_RESIDUAL:
                # Summed in the activation dtype, as the unfused `x + residual` is.
                a = a + tl.load(res_ptr + rows * stride_rm + offs_k[None, :], mask=mask, other=0.0)
                # Column-0 programs write it; a per-row test, as Triton's interpreter cannot broadcast a scalar mask.
                writer = (offs_m * 0 + pid_n) == 0
                tl.store(res_out_ptr + rows * stride_rom + offs_k[None, :], a, mask=mask & writer[:, None])
            a32 = a.to(tl.float32)
            sq = tl.sum(a32 * a32, 1)
            nw = tl.load(nw_ptr + offs_k, mask=mask_k, other=0.0).to(tl.float32)
            a = (a32 * nw[None, :]).to(W_DTYPE)
        else:
            a = a.to(W_DTYPE)
            sq = tl.zeros([offs_m.shape[0]], dtype=tl.float32)
    return a, sq


@triton.jit(do_not_specialize=["M", "M_BUCKET"])
def _gemv_kernel(
    x_ptr,
    res_ptr,
    nw_ptr,
    w_ptr,
    bias_ptr,
    y_ptr,
    res_out_ptr,
    part_ptr,
    sq_ptr,
    count_ptr,
    M,
    N,
    K,
    M_BUCKET,  # autotuning key only (the batch size's bucket)
    stride_xm,
    stride_rm,
    stride_wn,
    stride_ym,
    stride_rom,
    eps,
    PROLOGUE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    k_len = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_start = pid_k * k_len
    k_end = tl.minimum(k_start + k_len, K)
    w_rows = w_ptr + offs_n[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    sq = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < k_end
        w = tl.load(w_rows + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a, a_sq = _activation_tile(
            x_ptr, res_ptr, res_out_ptr, nw_ptr, offs_m, offs_k, mask_m, mask_k,
            stride_xm, stride_rm, stride_rom, K, pid_n, PROLOGUE, HAS_RESIDUAL, w.dtype,
        )  # fmt: skip
        sq += a_sq
        acc = tl.dot(a, tl.trans(w), acc)

    finish = True
    if SPLIT_K > 1:
        tile = pid_m * tl.num_programs(0) + pid_n
        tile_part = part_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_N)
        local = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
        tl.store(tile_part + pid_k * (BLOCK_M * BLOCK_N) + local, acc)
        tile_sq = sq_ptr + tile.to(tl.int64) * (SPLIT_K * BLOCK_M)
        tl.store(tile_sq + pid_k * BLOCK_M + tl.arange(0, BLOCK_M), sq)
        tl.debug_barrier()  # every thread's partial is stored before the release below publishes them
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel", scope="gpu")
        finish = arrived == SPLIT_K - 1
        if finish:  # the last K-slice of this tile: sum the others' partials into ours
            for j in range(0, SPLIT_K):
                if j != pid_k:
                    acc += tl.load(tile_part + j * (BLOCK_M * BLOCK_N) + local, cache_modifier=".cg")
                    sq += tl.load(tile_sq + j * BLOCK_M + tl.arange(0, BLOCK_M), cache_modifier=".cg")
            tl.store(count_ptr + tile, 0)
    if finish:
        if PROLOGUE == 1:
            acc = acc * tl.rsqrt(sq / K + eps)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + offs_m[:, None].to(tl.int64) * stride_ym + offs_n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@dataclass(frozen=True)
class GemvConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4

    def triton_config(self) -> triton.Config:
        kw = {
            "BLOCK_M": self.block_m,
            "BLOCK_N": self.block_n,
            "BLOCK_K": self.block_k,
            "SPLIT_K": self.split_k,
        }
        return triton.Config(kw, num_warps=self.num_warps, num_stages=self.num_stages)

    @staticmethod
    def of(config: triton.Config) -> GemvConfig:
        kw = config.kwargs
        return GemvConfig(
            kw["BLOCK_M"], kw["BLOCK_N"], kw["BLOCK_K"], kw["SPLIT_K"], config.num_warps, config.num_stages
        )


MAX_M = 256  # the largest batch the kernel is tuned for (the decode graphs' largest size)
_SPLITS = (1, 2, 4, 8)
# Per BLOCK_M, the weight tiles and pipelining depth that fit shared memory (<= ~160 KB) and leave every
# program a long enough K loop; the autotuner picks among them per (M bucket, N, K).
CONFIGS = [
    *(GemvConfig(16, bn, 256 if bn <= 32 else 128, s, 4, 4) for bn in (16, 32, 64, 128) for s in _SPLITS),
    *(GemvConfig(32, bn, 128, s, 4, 4) for bn in (32, 64) for s in _SPLITS),
    *(GemvConfig(64, bn, 64, s, 4, 3) for bn in (32, 64, 128) for s in _SPLITS),
    *(GemvConfig(128, bn, 64, s, 8, 3) for bn in (64, 128) for s in _SPLITS),
]
_BLOCK_M_FOR_BUCKET = {16: (16,), 32: (16, 32), 64: (32, 64), 128: (64, 128), 256: (64, 128)}


def m_bucket(m: int) -> int:
    """The autotuning bucket of a batch of m rows: 16 for m <= 16, else the next power of two."""
    if not 1 <= m <= MAX_M:
        raise ValueError(f"the Triton GEMV takes 1..{MAX_M} rows, got {m}")
    return max(16, triton.next_power_of_2(m))


def _programs(cfg: GemvConfig, m: int, n: int) -> int:
    return triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n) * cfg.split_k


def candidate_configs(m: int, n: int, k: int, num_sms: int) -> list[GemvConfig]:
    """The configs worth timing for m's bucket: BLOCK_M fit for the bucket, no empty K-slices, and between
    one and eight programs per multiprocessor at the bucket's size (else the one nearest that range). A
    function of the bucket, not of m, so every batch size of a bucket shares one autotuning result (in memory
    and in Triton's disk cache, whose key holds the candidates)."""
    bucket = m_bucket(m)
    fits = [
        c
        for c in CONFIGS
        if c.block_m in _BLOCK_M_FOR_BUCKET[bucket] and (c.split_k == 1 or (c.split_k - 1) * _k_len(c, k) < k)
    ]
    lo, hi = num_sms, 8 * num_sms
    inside = [c for c in fits if lo <= _programs(c, bucket, n) <= hi]
    if inside:
        return inside
    return [min(fits, key=lambda c: max(lo / _programs(c, bucket, n), _programs(c, bucket, n) / hi))]


def _k_len(cfg: GemvConfig, k: int) -> int:
    return triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter: any small count
    return torch.cuda.get_device_properties(device).multi_processor_count


def _prune(configs: list[triton.Config], named_args: dict, **kwargs: object) -> list[triton.Config]:
    m, n, k = named_args["M"], named_args["N"], named_args["K"]
    keep = set(candidate_configs(m, n, k, _num_sms(named_args["w_ptr"].device)))
    return [c for c in configs if GemvConfig.of(c) in keep]


def _bench(fn: Callable[[], object], quantiles: tuple[float, ...]) -> list[float]:
    # Short timings: a GEMV runs for microseconds, and every (bucket, N, K) is tuned at engine start.
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


_tuned_kernel = triton.autotune(
    configs=[c.triton_config() for c in CONFIGS],
    key=["M_BUCKET", "N", "K", "PROLOGUE", "HAS_RESIDUAL", "HAS_BIAS"],
    prune_configs_by={"early_config_prune": _prune},
    do_bench=_bench,
    cache_results=True,  # timings persist in Triton's cache dir: a second process on the machine skips them
)(_gemv_kernel)


class _Workspace:
    """Per-device split-K scratch: float32 partial tiles and square sums, and the per-tile arrival counters
    (zero between launches: the last program of a tile resets its counter). Grows only outside CUDA-graph
    capture; the warm-up runs before each capture size it."""

    def __init__(self) -> None:
        self._by_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def get(self, device: torch.device, part: int, sq: int, tiles: int) -> tuple[torch.Tensor, ...]:
        have = self._by_device.get(device)
        if have is None or have[0].numel() < part or have[1].numel() < sq or have[2].numel() < tiles:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(
                    "the GEMV split-K workspace must grow before CUDA-graph capture (warm up first)"
                )
            old = have or (torch.empty(0), torch.empty(0), torch.empty(0))
            have = (
                torch.empty(max(part, old[0].numel(), 1), dtype=torch.float32, device=device),
                torch.empty(max(sq, old[1].numel(), 1), dtype=torch.float32, device=device),
                torch.zeros(max(tiles, old[2].numel(), 1), dtype=torch.int32, device=device),
            )
            self._by_device[device] = have
        return have


_WORKSPACE = _Workspace()


def _split_scratch(cfgs: list[GemvConfig], m: int, n: int) -> tuple[int, int, int]:
    part = sq = tiles = 0
    for c in cfgs:
        if c.split_k > 1:
            t = triton.cdiv(m, c.block_m) * triton.cdiv(n, c.block_n)
            part = max(part, t * c.split_k * c.block_m * c.block_n)
            sq = max(sq, t * c.split_k * c.block_m)
            tiles = max(tiles, t)
    return part, sq, tiles


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: int = PROLOGUE_NONE,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    eps: float = 0.0,
    config: GemvConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y, new residual): y [M, N] = prologue(x) @ weight^T (+ bias) for weight [N, K] with dense rows.

    prologue PROLOGUE_NONE: x [M, K]. PROLOGUE_RMSNORM: x [M, K] (+ residual [M, K]) normalised with
    norm_weight [K] and eps; the new residual is x + residual (x itself without one). PROLOGUE_SILU_MUL:
    x [M, 2K] = [gate | up]. `config` pins a tiling (else autotuned on CUDA, the first candidate otherwise).
    """
    cfgs = [config] if config is not None else None
    launch = _Launch(x, weight, bias, prologue, residual, norm_weight, eps, cfgs)
    if x.shape[0] == 0:
        return launch.y, launch.res_out
    if config is None and x.is_cuda:
        _tuned_kernel[launch.grid](*launch.args, **launch.flags)
    else:
        c = launch.configs[0]
        meta = c.triton_config().kwargs
        _gemv_kernel[launch.grid](
            *launch.args, **launch.flags, **meta, num_warps=c.num_warps, num_stages=c.num_stages
        )
    return launch.y, launch.res_out


def compile_configs(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    prologue: int = PROLOGUE_NONE,
    residual: torch.Tensor | None = None,
    norm_weight: torch.Tensor | None = None,
    configs: list[GemvConfig] | None = None,
) -> int:
    """Compiles (into Triton's cache, without running) the kernels `gemv` would try on these arguments:
    `benchmark/kernel_bench.py` fills the cache from several processes at once. Returns how many."""
    launch = _Launch(x, weight, bias, prologue, residual, norm_weight, 0.0, configs)
    for c in launch.configs:
        meta = c.triton_config().kwargs
        _gemv_kernel.warmup(
            *launch.args,
            grid=(1, 1, 1),
            **launch.flags,
            **meta,
            num_warps=c.num_warps,
            num_stages=c.num_stages,
        )
    return len(launch.configs)


class _Launch:
    """The kernel arguments of one call: checked shapes, outputs, split-K scratch for every config tried."""

    def __init__(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        prologue: int,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor | None,
        eps: float,
        configs: list[GemvConfig] | None,
    ) -> None:
        m = x.shape[0]
        n, k = weight.shape
        if weight.stride(1) != 1 or x.stride(-1) != 1:
            raise ValueError("the GEMV needs dense weight and activation rows")
        width = 2 * k if prologue == PROLOGUE_SILU_MUL else k
        if x.dim() != 2 or x.shape[1] != width:
            raise ValueError(
                f"activation {tuple(x.shape)} does not fit weight {tuple(weight.shape)} (rows of {width})"
            )
        self.y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        self.res_out = None
        if prologue == PROLOGUE_RMSNORM:
            if norm_weight is None:
                raise ValueError("the RMSNorm prologue needs its weight")
            self.res_out = torch.empty_like(x) if residual is not None else x
        if m == 0:
            return
        self.configs = configs or candidate_configs(m, n, k, _num_sms(x.device))
        part, sq, counts = _WORKSPACE.get(x.device, *_split_scratch(self.configs, m, n))
        res = residual if residual is not None else x
        res_out = self.res_out if residual is not None else self.y  # only written with a residual
        self.args = (
            x, res, norm_weight if norm_weight is not None else weight, weight, bias if bias is not None else weight,
            self.y, res_out, part, sq, counts, m, n, k, m_bucket(m),
            x.stride(0), res.stride(0), weight.stride(0), self.y.stride(0), res_out.stride(0), eps,
        )  # fmt: skip
        self.flags = {
            "PROLOGUE": prologue,
            "HAS_RESIDUAL": residual is not None,
            "HAS_BIAS": bias is not None,
        }
        self.grid = lambda meta: (
            triton.cdiv(n, meta["BLOCK_N"]),
            meta["SPLIT_K"],
            triton.cdiv(m, meta["BLOCK_M"]),
        )


def tuned_config(
    m: int, n: int, k: int, prologue: int, has_residual: bool, has_bias: bool
) -> GemvConfig | None:
    """The config the autotuner chose for this shape in this process (None before its first call)."""
    key_head = (m_bucket(m), n, k, prologue, has_residual, has_bias)
    for key, cfg in _tuned_kernel.cache.items():
        if tuple(key[: len(key_head)]) == key_head:
            return GemvConfig.of(cfg)
    return None
