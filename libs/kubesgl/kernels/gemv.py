"""Which kernel computes a linear layer y = x W^T, and the fused decode-batch forms of the ones that follow
a norm or an activation (their torch compositions are the references).

`--linear-backend`: "torch" (default) is F.linear and the separate norm / SiLU kernels everywhere; "triton"
runs batches of up to `gemv_triton.MAX_M` rows through the Triton GEMV (`kernels/gemv_triton.py`), with
residual add + RMSNorm in the prologue of the qkv and gate_up projections and SiLU-and-mul in the down
projection's; "auto" does the same on CUDA up to AUTO_MAX_ROWS rows for the projections and AUTO_LM_HEAD_MAX_ROWS for the
LM head (the batch sizes where the kernel beats cuBLAS on the H200: benchmark/kernel_bench.py's table) and is
torch elsewhere. Prefill batches are larger and always take F.linear.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kubesgl.kernels.activation import silu_and_mul
from kubesgl.kernels.dispatch import triton_installed
from kubesgl.kernels.norm import fused_add_rms_norm, rms_norm

LINEAR_BACKENDS = ("torch", "triton", "auto")
TRITON_MAX_ROWS = 256  # gemv_triton.MAX_M, without importing triton here
# Rows up to which "auto" takes the Triton GEMV: guesses until benchmark/kernel_bench.py's table on the H200.
AUTO_MAX_ROWS = 64
AUTO_LM_HEAD_MAX_ROWS = 64


@dataclass(frozen=True)
class LinearBackend:
    """The policy the linear layers of a model share: which batches take the Triton GEMV (`lm_head`: the
    policy of the LM head, whose 151k-row weight favours other tilings than the projections')."""

    name: str = "torch"
    lm_head: bool = False

    def __post_init__(self) -> None:
        if self.name not in LINEAR_BACKENDS:
            raise ValueError(f"linear backend {self.name!r}: choose one of {', '.join(LINEAR_BACKENDS)}")

    @property
    def max_rows(self) -> int:
        auto = AUTO_LM_HEAD_MAX_ROWS if self.lm_head else AUTO_MAX_ROWS
        return {"torch": 0, "triton": TRITON_MAX_ROWS, "auto": auto}[self.name]

    def takes(self, x: torch.Tensor) -> bool:
        """True when this batch of rows runs through the Triton GEMV: CUDA tensors, or CPU tensors under
        Triton's interpreter (the CPU tests) for "triton"."""
        if not 1 <= x.shape[0] <= self.max_rows or not triton_installed():
            return False
        return x.is_cuda or (self.name == "triton" and _interpreter_active())


TORCH = LinearBackend("torch")


def _interpreter_active() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    from kubesgl.kernels import gemv_triton

    return isinstance(gemv_triton._gemv_kernel, InterpretedFunction)


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: LinearBackend
) -> torch.Tensor:
    if backend.takes(x):
        from kubesgl.kernels.gemv_triton import gemv

        return gemv(x, weight, bias)[0]
    return F.linear(x, weight, bias)


def rmsnorm_linear(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    backend: LinearBackend,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(linear(rmsnorm(x + residual)), x + residual); without a residual, (linear(rmsnorm(x)), x)."""
    if backend.takes(x):
        from kubesgl.kernels.gemv_triton import PROLOGUE_RMSNORM, gemv

        y, summed = gemv(
            x, weight, bias, prologue=PROLOGUE_RMSNORM, residual=residual, norm_weight=norm_weight, eps=eps
        )
        assert summed is not None
        return y, summed
    if residual is None:
        return F.linear(rms_norm(x, norm_weight, eps), weight, bias), x
    normed, summed = fused_add_rms_norm(x, residual, norm_weight, eps)
    return F.linear(normed, weight, bias), summed


def silu_mul_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, backend: LinearBackend
) -> torch.Tensor:
    """linear(silu(x[:, :d]) * x[:, d:])."""
    if backend.takes(x):
        from kubesgl.kernels.gemv_triton import PROLOGUE_SILU_MUL, gemv

        return gemv(x, weight, bias, prologue=PROLOGUE_SILU_MUL)[0]
    return F.linear(silu_and_mul(x), weight, bias)
