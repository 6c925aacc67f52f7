"""Projections of a handful of rows (decode at batch <= GEMV_MAX_ROWS) as one Triton GEMV kernel on CUDA.

At batch 1 the decode step's four projections per layer run as cuBLAS GEMMs at ~1.1-1.4 TB/s, with several
microseconds of fixed cost each beyond their bytes, and cuBLAS's launches take no programmatic dependent launch
(docs/performance.md, issue 25). `gemv_triton` holds each program's weight slice in registers, loaded before
it waits on the previous kernel, so the weight stream starts while a small norm or attention kernel still runs.
`gate_up_silu` also folds a dense MLP's SiLU·mul into its gate_up GEMV (one kernel and one boundary less per layer),
and `norm_linear` the RMSNorm before a projection (the decoder's input norm before qkv, its residual norm
before gate_up: two more per layer).
On by default on CUDA (measured: on an H100 the batch-1 decode step went 1.483 -> 1.109 ms with the GEMV, 1.073
with the SiLU fold; with the norm folds 1.107 -> 1.030 on another H100 and 0.956 -> 0.881 on an H200; offline
throughput unchanged; docs/performance.md). KUBESGL_GEMV=0 keeps cuBLAS and SiluAndMul; KUBESGL_GEMV_SILU=0 and
KUBESGL_GEMV_NORM=0 turn off only their fold. Each program's sums run in a fixed order (no atomics: run to run
identical), another order than cuBLAS's: outputs differ from it within the dtype's rounding.

Batches of 5-256 rows take the mid-batch GEMM (`gemm_triton`: tensor cores, PDL, split-K summed in a fixed order)
where `SKINNY_TABLE` names a config for the projection's shape and rows bucket: the sweep found it ahead of cuBLAS
at 8-32 rows (1.07-1.48x per projection) and behind it at 256 (0.79-0.84x), so the table keeps cuBLAS there;
offline on an H200 it is +0.6 % (three pairs, each ahead). KUBESGL_SKINNY_GEMM=0 keeps cuBLAS.
Its table also names the qkv prep after the qkv projection (op "prep", `qkv_linear_prep`: the q/k norm, RoPE and
KV store in the GEMM's epilogue) at 8-32 rows, where it measured 1.14-1.21x of the two kernels.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from kubesgl import env
from kubesgl.kernels.dispatch import use_triton
from kubesgl.kernels.gemm_config import GemmConfig
from kubesgl.kernels.qkv_prep import QkvPrep

GEMV_MAX_ROWS = 4
GEMV_MAX_K = 4096  # a program holds [N/programs, K] in registers; larger K keeps cuBLAS
# The mid-batch GEMM (gemm_triton) serves GEMV_MAX_ROWS < M <= SKINNY_MAX_ROWS, where its table says.
SKINNY_MAX_ROWS = 256
SKINNY_DTYPES = (torch.bfloat16, torch.float16)  # float32 would run tl.dot in TF32, which F.linear does not

# What one launch of the mid-batch GEMM does (`gemm_triton`): the projection alone, with the SiLU·mul of [gate; up]
# folded in, or the qkv projection with its q/k norm, RoPE and KV store (prep). N is the output width (gate_up's
# half).
SKINNY_OPS = ("linear", "silu", "prep")
_LEGACY_OPS = {"0": "linear", "1": "silu"}  # the fifteenth session's tables: "n,k,silu,bucket"

# Mid-batch GEMM configs (N, K, op, rows bucket) -> config, only where the kernel beat cuBLAS by >= 3 % at that
# shape and bucket (benchmark/skinny_sweep.py on a lent H200, 132 SMs, 2026-12-07: benchmark/results/
# call1_2026-12-07_s15/); every other shape, Qwen3-0.6B's at 256 rows and its qkv above 16 among them, keeps cuBLAS.
SKINNY_TABLE: dict[tuple[int, int, str, int], str] = {
    (4096, 1024, "linear", 8): "m16n64k128s4w4p3",
    (1024, 2048, "linear", 8): "m16n64k128s8w4p3",
    (3072, 1024, "silu", 8): "m16n64k128s1w4p3",
    (1024, 3072, "linear", 8): "m16n64k128s8w4p3",
    (4096, 1024, "linear", 16): "m16n64k128s4w4p3",
    (1024, 2048, "linear", 16): "m16n32k128s8w4p3",
    (3072, 1024, "silu", 16): "m16n64k128s1w4p3",
    (1024, 3072, "linear", 16): "m16n32k64s8w4p4",
    (1024, 2048, "linear", 32): "m32n32k128s4w4p3",
    (3072, 1024, "silu", 32): "m32n64k128s1w4p3",
    (1024, 3072, "linear", 32): "m32n32k64s8w4p4",
    (1024, 2048, "linear", 64): "m64n32k64s4w4p4",
    (1024, 3072, "linear", 64): "m64n32k64s4w4p4",
    (1024, 3072, "linear", 128): "m64n64k128s4w4p3",
    # the qkv projection with its prep (seventeenth session, lent H100: 1.21 / 1.21 / 1.14x of the table's qkv +
    # qkv_prep at 8 / 16 / 32 rows; 0.89-0.99x from 64 rows on, so those keep the two kernels)
    (4096, 1024, "prep", 8): "m16n64k128s4w4p3",
    (4096, 1024, "prep", 16): "m16n64k128s4w4p3",
    (4096, 1024, "prep", 32): "m32n64k128s2w4p3",
}


def rows_bucket(m: int) -> int:
    """The table's row bucket of an M-row batch: the power of two at or above it, at least 8."""
    return max(8, 1 << (m - 1).bit_length())


@functools.cache
def _table_from(path: str | None) -> dict[tuple[int, int, str, int], GemmConfig]:
    """The built-in table, or the one a sweep wrote (KUBESGL_SKINNY_CONFIGS: {"n,k,op,bucket": config key}, op
    one of SKINNY_OPS, or 0 / 1 for linear / silu)."""
    if not path:
        return {key: GemmConfig.parse(cfg) for key, cfg in SKINNY_TABLE.items()}
    try:
        with open(path) as f:
            raw = json.load(f)["configs"]
        table = {}
        for key, cfg in raw.items():
            n, k, op, bucket = key.split(",")
            op = _LEGACY_OPS.get(op, op)
            if op not in SKINNY_OPS:
                raise ValueError(f"op {op!r} is none of {SKINNY_OPS}")
            table[(int(n), int(k), op, int(bucket))] = GemmConfig.parse(cfg)
    except (OSError, ValueError, KeyError, AttributeError) as e:
        raise ValueError(
            f"KUBESGL_SKINNY_CONFIGS={path}: not a sweep's table ({{'configs': {{'n,k,op,bucket': key}}}}): {e}"
        ) from e
    return table


def skinny_table_size() -> int:
    """Entries of the mid-batch GEMM's table in force: 0 with the switch off."""
    return len(_table_from(env.skinny_configs())) if env.skinny_gemm() else 0


@functools.cache
def _hopper(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] == 9


def skinny_config(x: torch.Tensor, weight: torch.Tensor, *, op: str = "linear") -> GemmConfig | None:
    """The mid-batch GEMM's config for `op` (SKINNY_OPS) on x [M, K] @ weight [N, K]^T (weight [2N, K] for the
    silu ops): None where it does not apply (switch off, not CUDA Hopper, M outside (GEMV_MAX_ROWS,
    SKINNY_MAX_ROWS], not bf16/fp16, not dense, or no measured config for the shape)."""
    m = x.shape[0] if x.dim() == 2 else 0
    if not (GEMV_MAX_ROWS < m <= SKINNY_MAX_ROWS and x.dtype in SKINNY_DTYPES and weight.dtype == x.dtype):
        return None
    if not (env.skinny_gemm() and x.stride(-1) == 1 and weight.stride(-1) == 1 and use_triton(x)):
        return None
    if not _hopper(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return None
    n = weight.shape[0] // 2 if op.endswith("silu") else weight.shape[0]
    return _table_from(env.skinny_configs()).get((n, weight.shape[1], op, rows_bucket(m)))


def gemv_applies(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` takes the Triton GEMV for x [M, K] and weight [N, K] (switch on, CUDA, M and K small)."""
    return (
        x.dim() == 2
        and x.shape[0] <= GEMV_MAX_ROWS
        and env.gemv()
        and weight.shape[1] <= GEMV_MAX_K
        and x.stride(-1) == 1
        and weight.stride(-1) == 1
        and use_triton(x)
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the GEMV kernel where `gemv_applies` (and there is no bias)."""
    if bias is None and gemv_applies(x, weight):
        from kubesgl.kernels import gemv_triton

        return gemv_triton.gemv(x, weight)
    if bias is None and (cfg := skinny_config(x, weight)) is not None:
        from kubesgl.kernels import gemm_triton

        return gemm_triton.skinny_gemm(x, weight, cfg)
    return F.linear(x, weight, bias)


def gate_up_silu(
    x: torch.Tensor, gate_up: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor | None:
    """silu(x @ gate.T) * (x @ up.T) for gate_up = [gate; up] [2I, K] as one GEMV kernel where `gemv_applies`,
    there is no bias and KUBESGL_GEMV_SILU is on, or as the mid-batch GEMM with the same fold where
    `skinny_config` has one; None otherwise (the caller runs the projection and SiluAndMul)."""
    if bias is not None or not env.gemv_silu():
        return None
    if gemv_applies(x, gate_up):
        from kubesgl.kernels import gemv_triton

        return gemv_triton.gemv_silu_mul(x, gate_up)
    if (cfg := skinny_config(x, gate_up, op="silu")) is not None:
        from kubesgl.kernels import gemm_triton

        return gemm_triton.skinny_gemm(x, gate_up, cfg, silu=True)
    return None


def norm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """An RMSNorm (with its residual add) and the projection after it as one GEMV kernel: (projection, or
    silu·mul of [gate; up] when `silu`, of norm(x + residual), x + residual) where `gemv_applies`, there is no
    bias, x has the norm weight's dtype, the residual (if any) is dense and x's dtype and shape, and the norm
    fold (and for `silu` the SiLU fold) is on; None otherwise (the caller runs the norm and the projection). A
    float32 x is the fused MLP's sum, which the separate norm rounds into the residual's dtype first."""
    if bias is not None or not (
        gemv_applies(x, weight) and env.gemv_norm() and (env.gemv_silu() or not silu)
    ):
        return None
    if x.dtype != norm_weight.dtype:
        return None
    if residual is not None and (
        residual.dtype != x.dtype or residual.shape != x.shape or not residual.is_contiguous()
    ):
        return None
    from kubesgl.kernels import gemv_triton

    return gemv_triton.norm_gemv(x, residual, norm_weight, eps, weight, silu=silu)


def qkv_linear_prep(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, prep: Callable[[], QkvPrep]
) -> torch.Tensor | None:
    """The fused qkv projection of x (the input norm's output) and its q/k norms, RoPE and K/V store as one
    mid-batch GEMM, where its table has the "prep" op and there is no bias: q [M, q_heads * D]; None otherwise.
    `prep` builds the epilogue's arguments, only when the fold runs."""
    if bias is not None or (cfg := skinny_config(x, weight, op="prep")) is None:
        return None
    from kubesgl.kernels import gemm_triton

    args = prep()
    # the table is keyed by shape alone: another head layout of the same width keeps the two kernels
    if gemm_triton.prep_layout_error(args, weight.shape[0], cfg) is not None:
        return None
    return gemm_triton.qkv_prep_gemm(x, weight, cfg, args)
