"""Fused GPU fast paths for the model layers, each a Triton kernel on CUDA with a torch fallback elsewhere.

Import from here: `rms_norm`, `fused_add_rms_norm`, `apply_rotary_neox`, `silu_and_mul`, `fused_moe`, `fused_mlp`.
The `*_triton` modules hold the kernels and import triton; the dispatching modules do not.
"""

from __future__ import annotations

from kubesgl.kernels.activation import silu_and_mul
from kubesgl.kernels.fused_mlp import fused_mlp
from kubesgl.kernels.fused_moe import fused_moe
from kubesgl.kernels.norm import fused_add_rms_norm, rms_norm
from kubesgl.kernels.rotary import apply_rotary_neox

__all__ = ["apply_rotary_neox", "fused_add_rms_norm", "fused_mlp", "fused_moe", "rms_norm", "silu_and_mul"]
