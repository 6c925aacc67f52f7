"""Applies a packed token bitmask to logits in place: bit j of row i's int32 word j // 32 set means token j is
allowed; a cleared bit sets logits[i, j] to -inf. Rows whose words are all ones are left bit-identical, so a
whole batch can be masked at a fixed shape (captured sampler graphs) with its unconstrained rows all ones.

Three implementations, chosen by `backend` ("auto": Triton on CUDA, xgrammar's C++ kernel on CPU):
- "triton": ours, one program per (row, 4096 tokens); no host sync, so a CUDA graph can capture it. Runs on
  CPU tensors under TRITON_INTERPRET=1 (how CPU CI checks it).
- "cpu": xgrammar's C++ kernel (CPU tensors only; `rows` as host ints).
- "torch": plain torch ops, any device, graph-capturable; it materializes a [rows, vocab] bool mask.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

Backend = Literal["auto", "triton", "cpu", "torch"]
_BLOCK = 4096


def apply_token_bitmask_(
    logits: torch.Tensor,
    bitmask: torch.Tensor,
    rows: torch.Tensor | Sequence[int] | None = None,
    *,
    backend: Backend = "auto",
) -> torch.Tensor:
    """logits [B, V] (float32/bf16/fp16, row stride any, unit column stride); bitmask int32 [B, ceil(V / 32)]
    on the same device, row i for logits row i. `rows`: only these rows are masked (None: all). Returns logits."""
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or logits.dim() != 2:
        raise ValueError("need logits [B, V] and an int32 bitmask [B, ceil(V / 32)]")
    if bitmask.shape[1] * 32 < logits.shape[1] or bitmask.shape[0] < logits.shape[0]:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} does not cover logits {tuple(logits.shape)}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask on {bitmask.device}, logits on {logits.device}")
    if backend == "auto":
        backend = "triton" if logits.is_cuda else "cpu"
    if backend == "torch":
        return _apply_torch_(logits, bitmask, rows)
    if backend == "cpu":
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

        host_rows = rows.tolist() if isinstance(rows, torch.Tensor) else None if rows is None else list(rows)
        apply_token_bitmask_inplace_cpu(logits, bitmask, logits.shape[1], host_rows)
        return logits
    if backend == "triton":
        from kubesgl.structured.bitmask_triton import apply_token_bitmask_triton_

        return apply_token_bitmask_triton_(logits, bitmask, rows)
    raise ValueError(f"unknown backend {backend!r}")


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The ids allowed by one packed row (a bool [vocab_size]); for tests and debugging."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask_row.device)
    return (((bitmask_row[:, None] >> bits) & 1) != 0).flatten()[:vocab_size]


def _apply_torch_(
    logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | Sequence[int] | None
) -> torch.Tensor:
    b, v = logits.shape
    bits = torch.arange(32, dtype=torch.int32, device=logits.device)
    if rows is None:
        allowed = ((bitmask[:b, :, None] >> bits) & 1).view(b, -1)[:, :v] != 0
        return logits.masked_fill_(~allowed, float("-inf"))
    idx = torch.as_tensor(rows, dtype=torch.int64, device=logits.device)
    allowed = ((bitmask[idx][:, :, None] >> bits) & 1).flatten(1)[:, :v] != 0
    logits[idx] = logits[idx].masked_fill(~allowed, float("-inf"))
    return logits
