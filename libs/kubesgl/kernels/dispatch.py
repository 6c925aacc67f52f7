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
    torch.compile traces: Inductor fuses the torch ops itself (engine/compile.py). That is asked first: traced,
    `triton_installed` calls importlib, which Dynamo refuses to trace ("Attempted to call function marked as
    skipped", as every compiled CUDA forward failed on the H100 on 2026-12-06; CPU tensors stop at `is_cuda`)."""
    return not torch.compiler.is_compiling() and x.is_cuda and triton_installed()
