"""Triton RMSNorm: one program per row, the whole row in registers, residual add fused in."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)  # a weight: readable before the previous kernel ends
    pdl_wait(USE_PDL)
    pdl_launch_dependents(USE_PDL)
    x = tl.load(x_ptr + row * n_cols + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Summed in the activation dtype, as the unfused `x + residual` would be (a float32 x, the fused
        # MLP's sum, is rounded to it first, where the down GEMM would have rounded).
        res = tl.load(res_ptr + row * n_cols + offs, mask=mask, other=0.0)
        x = x.to(res.dtype) + res
        tl.store(sum_ptr + row * n_cols + offs, x, mask=mask)
    x32 = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x32 * x32, 0) / n_cols + eps)
    y = (x32 * rstd).to(x.dtype) * w
    tl.store(out_ptr + row * n_cols + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float) -> tuple:
    n_cols = x.shape[-1]
    x2 = x.reshape(-1, n_cols).contiguous()
    act_dtype = residual.dtype if residual is not None else x.dtype
    out = torch.empty(x2.shape, dtype=torch.promote_types(act_dtype, weight.dtype), device=x.device)
    summed = torch.empty(x2.shape, dtype=act_dtype, device=x.device) if residual is not None else x2
    res2 = residual.reshape(-1, n_cols).contiguous() if residual is not None else x2
    block = triton.next_power_of_2(n_cols)
    _rms_norm_kernel[(x2.shape[0],)](
        x2,
        res2,
        weight,
        out,
        summed,
        n_cols,
        eps,
        HAS_RESIDUAL=residual is not None,
        BLOCK=block,
        num_warps=min(16, max(1, block // 256)),
        **pdl_kwargs(x2),
    )
    return out.view(x.shape), summed.view(x.shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    out, summed = _launch(x, residual, weight, eps)
    return out, summed
