"""The device side of `kernels.l2_prefetch`: one program per 64 KiB of the tensors, one prefetch per 128-byte line."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kubesgl.kernels.pdl import pdl_kwargs
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait

LINE = 128  # bytes per L2 line
LINES = 512  # lines per program


@triton.jit
def _prefetch(base, n, chunk, LINES: tl.constexpr):
    # lines past the tensor's end are clamped to its last line (a repeated hint costs nothing)
    offs = tl.minimum(chunk * LINES + tl.arange(0, LINES), n - 1).to(tl.int64) * 128
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [base + offs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, LINES: tl.constexpr, USE_PDL: tl.constexpr):
    """Programs laid out tensor by tensor (n*: each byte view's line count)."""
    pid = tl.program_id(0)
    c0 = tl.cdiv(n0, LINES)
    c1 = c0 + tl.cdiv(n1, LINES)
    c2 = c1 + tl.cdiv(n2, LINES)
    if pid < c0:
        _prefetch(p0, n0, pid, LINES)
    elif pid < c1:
        _prefetch(p1, n1, pid - c0, LINES)
    elif pid < c2:
        _prefetch(p2, n2, pid - c1, LINES)
    else:
        _prefetch(p3, n3, pid - c2, LINES)
    pdl_wait(USE_PDL)  # completes after its predecessor, as every PDL kernel of ours
    pdl_launch_dependents(USE_PDL)


def prefetch_lines(views: list[torch.Tensor]) -> None:
    """`views`: 1-4 flat uint8 CUDA tensors."""
    lines = [triton.cdiv(v.numel(), LINE) for v in views]
    while len(views) < 4:  # unused slots: no lines, so no program reads their pointer
        views, lines = [*views, views[0]], [*lines, 0]
    grid = (sum(triton.cdiv(n, LINES) for n in lines),)
    args = [a for v, n in zip(views, lines, strict=True) for a in (v, n)]
    _prefetch_kernel[grid](*args, LINES=LINES, num_warps=4, **pdl_kwargs(views[0]))
