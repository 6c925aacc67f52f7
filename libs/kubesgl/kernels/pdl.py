"""Programmatic dependent launch (PDL) for our Triton kernels on Hopper and later (sm90+).

A kernel launched with PDL may start while the kernel before it in the stream is still draining: its
programs run what does not depend on that kernel (weights, tables, index math), then `gdc_wait` until the
previous grid's writes are visible. Inside a CUDA graph the launch becomes a programmatic edge, so a decode
step's kernel boundaries overlap instead of each paying the full drain-and-launch latency.

`pdl_kwargs(x)` is what a launch passes: the kernel's `USE_PDL` constexpr, plus Triton's `launch_pdl` option
when PDL is on. Off on CPU tensors, under the Triton interpreter (which has no grid-dependency ops), before
sm90, and when KUBESGL_DISABLE_PDL is set. Every program of a PDL kernel waits before touching activations,
even one with nothing to do: a grid can only be counted complete after its predecessor then.
"""

from __future__ import annotations

import functools
import os

import torch

from kubesgl import env


@functools.cache
def _device_supports_pdl(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(x: torch.Tensor) -> bool:
    """Whether a Triton kernel reading `x` launches with programmatic dependent launch."""
    if not x.is_cuda or env.disable_pdl() or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if torch.compiler.is_compiling():  # a graph torch.compile traces launches our kernels plainly
        return False
    return _device_supports_pdl(x.device.index if x.device.index is not None else torch.cuda.current_device())


def pdl_kwargs(x: torch.Tensor) -> dict[str, bool]:
    """Launch keywords for a kernel with a `USE_PDL: tl.constexpr` parameter (see `pdl_triton`)."""
    if pdl_enabled(x):
        return {"USE_PDL": True, "launch_pdl": True}
    return {"USE_PDL": False}
