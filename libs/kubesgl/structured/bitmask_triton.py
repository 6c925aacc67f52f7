"""The Triton kernel behind apply_token_bitmask_(backend="triton"): one program per (row, 4096 tokens) sets
the banned logits to -inf. No host sync and no data-dependent shapes, so a CUDA graph captures it."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _bitmask_kernel(
    logits_ptr,
    logits_stride,
    mask_ptr,
    mask_stride,
    rows_ptr,
    vocab,
    HAS_ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    if HAS_ROWS:
        row = tl.load(rows_ptr + r).to(tl.int64)
    else:
        row = r.to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab
    # Each word is loaded by the 32 lanes of its tokens; they share one cache line.
    words = tl.load(mask_ptr + row * mask_stride + offs // 32, mask=inside, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & banned)


def apply_token_bitmask_triton_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | Sequence[int] | None = None
) -> torch.Tensor:
    """As apply_token_bitmask_; `rows` (device int tensor for graphs) picks the rows to mask."""
    if logits.stride(1) != 1:
        raise ValueError("logits need unit column stride")
    b, v = logits.shape
    if rows is None:
        n, idx = b, bitmask  # a placeholder pointer: the kernel reads no rows when HAS_ROWS is off
    else:
        idx = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
        n = idx.numel()
    if n == 0:
        return logits
    _bitmask_kernel[(n, triton.cdiv(v, BLOCK))](
        logits,
        logits.stride(0),
        bitmask,
        bitmask.stride(0),
        idx,
        v,
        HAS_ROWS=rows is not None,
        BLOCK=BLOCK,
    )
    return logits
