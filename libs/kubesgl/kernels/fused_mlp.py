"""The decode MLP in one kernel for small batches: down(silu(gate(x)) * up(x)), split over the intermediate dim.

At decode batch sizes the unfused MLP is three launches (the gate_up GEMM, SiLU·mul, the down GEMM), each
with a fixed cost of several microseconds beyond its bytes (docs/performance.md). `fused_mlp` runs them as one
Triton kernel on CUDA for up to `FUSED_MLP_MAX_ROWS` rows: each program takes a slice of the intermediate dim,
computes its gate and up columns, the activation, and that slice's share of the down projection, and adds it
into a float32 [M, hidden] sum. The sum is what the next `fused_add_rms_norm` reads (it rounds to the
activation dtype first, where the down GEMM would have rounded). The float32 adds arrive in any order, so the
result is not bit-reproducible from run to run; the path is behind KUBESGL_FUSED_MLP until measured.

`fused_mlp_torch` is the unfused reference, the kernel's parity target.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kubesgl import env
from kubesgl.kernels.activation import silu_and_mul_torch
from kubesgl.kernels.dispatch import use_triton

FUSED_MLP_MAX_ROWS = 16  # one tl.dot tile of rows; larger batches keep cuBLAS


def fused_mlp_torch(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    return F.linear(silu_and_mul_torch(F.linear(x, w_gate_up)), w_down)


def fused_mlp_applies(x: torch.Tensor) -> bool:
    """Whether `fused_mlp` takes the one-kernel path for `x` [M, hidden] (switch on, CUDA, M small)."""
    return env.fused_mlp() and use_triton(x) and x.shape[0] <= FUSED_MLP_MAX_ROWS


def fused_mlp(x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor) -> torch.Tensor:
    """x [M, H], w_gate_up [2I, H] ([gate | up] rows), w_down [H, I] -> [M, H]: float32 on the fused path
    (where `fused_mlp_applies`), the activation dtype otherwise."""
    if fused_mlp_applies(x):
        from kubesgl.kernels import fused_mlp_triton

        return fused_mlp_triton.fused_mlp(x, w_gate_up, w_down)
    return fused_mlp_torch(x, w_gate_up, w_down)
