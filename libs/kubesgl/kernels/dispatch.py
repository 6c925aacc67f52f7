"""Decides per call whether a Triton kernel can run on a tensor."""

from __future__ import annotations

import functools
import importlib.util

import torch


@functools.cache
def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: torch.Tensor) -> bool:
    """Triton serves CUDA tensors; everything else takes the torch path. So does a forward pass that
    torch.compile traces: Inductor fuses the torch ops itself (engine/compile.py)."""
    return x.is_cuda and triton_installed() and not torch.compiler.is_compiling()
