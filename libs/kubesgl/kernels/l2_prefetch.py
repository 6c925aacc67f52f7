"""The next sub-layers' weights pulled into L2 while a decode step's attention drains (KUBESGL_L2_PREFETCH).

Between one layer's attention and the next layer's the decode step is one chain of small GEMMs (o, gate_up, down,
the next qkv) and the small kernels between them; each GEMM streams its 4-13 MB of weights at a fraction of HBM's
rate, because its first loads, its tail and the launch before it leave HBM idle. `prefetch_l2` issues one
`prefetch.global.L2` per 128-byte line of those weights in one launch right after attention (PDL: it may start while
attention's last programs run), so the lines stream at HBM rate behind the GEMMs, which then read them from L2.
A hint only: no result depends on it. CUDA sm80+ only, never under the Triton interpreter (inline PTX).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from kubesgl import env

MAX_TENSORS = 4


@functools.cache
def _device_ok(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 8


def prefetch_applies(x: torch.Tensor) -> bool:
    """Whether `prefetch_l2` runs for a step whose activations are `x`: on by KUBESGL_L2_PREFETCH, CUDA sm80+,
    not interpreted, not inside torch.compile's trace."""
    if not env.l2_prefetch() or not x.is_cuda or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return False
    if torch.compiler.is_compiling():
        return False
    return _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device())


def prefetch_l2(weights: Sequence[torch.Tensor]) -> None:
    """Prefetch hints for every line of up to four contiguous CUDA tensors, in one kernel launch."""
    from kubesgl.kernels.l2_prefetch_triton import prefetch_lines

    if not 0 < len(weights) <= MAX_TENSORS or not all(w.is_cuda and w.is_contiguous() for w in weights):
        raise ValueError(f"prefetch_l2 takes 1-{MAX_TENSORS} contiguous CUDA tensors")
    prefetch_lines([w.view(-1).view(torch.uint8) for w in weights])
