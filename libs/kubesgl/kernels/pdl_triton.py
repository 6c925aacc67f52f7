"""The device side of `kernels.pdl`: grid-dependency waits and triggers, compiled out unless USE_PDL."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Blocks until the previous kernel's writes are visible; every program calls it before reading them."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()


@triton.jit
def pdl_launch_dependents(USE_PDL: tl.constexpr):
    """Lets the next PDL kernel start its prologue (it still waits for this grid to finish before reading)."""
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
