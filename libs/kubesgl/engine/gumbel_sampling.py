"""Temperature sampling in one pass over the logits (Triton): argmax of logits / T + Gumbel noise per row.

argmax_v (l_v / T + G_v) with G_v = -log(-log U_v) draws v with probability softmax(l / T)_v (the Gumbel-max
trick), so no softmax, no noise tensor and no float32 copy of the [B, vocab] logits are written: the kernel
reads each logit once. Greedy rows (scale < 0) take the plain argmax, first index on ties like torch's.
The noise comes from Philox keyed by (engine seed, step counter): the counter lives on the device and the
captured graph advances it, so every replay draws fresh noise and every TP rank draws the same.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096


@triton.jit
def _gumbel_argmax_kernel(logits_ptr, stride, scale_ptr, key_ptr, out_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    scale = tl.load(scale_ptr + row)
    key = tl.load(key_ptr)
    best_val = tl.full([1], float("-inf"), tl.float32)
    best_idx = tl.full([1], 0, tl.int32)
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < vocab
        logit = tl.load(logits_ptr + row * stride + cols, mask=mask, other=float("-inf")).to(tl.float32)
        u = tl.rand(key, row * vocab + cols)
        score = tl.where(scale < 0, logit, logit * scale - tl.log(-tl.log(u)))
        score = tl.where(mask, score, float("-inf"))
        m = tl.max(score, 0)
        i = tl.argmax(score, 0)
        take = m > best_val
        best_idx = tl.where(take, start + i, best_idx)
        best_val = tl.where(take, m, best_val)
    tl.store(out_ptr + row + tl.arange(0, 1), best_idx.to(tl.int64))


def gumbel_tokens(logits: torch.Tensor, scale: torch.Tensor, key: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous); scale [B] float32 = 1 / T, or -1 for greedy rows;
    key [1] int64 Philox key (advance it between steps). Returns the tokens [B] int64."""
    b, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    _gumbel_argmax_kernel[(b,)](logits, logits.stride(0), scale, key, out, vocab, BLOCK=BLOCK, num_warps=8)
    return out


def sampling_scale(temperature: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Per row 1 / T, or -1 where the row is greedy."""
    return torch.where(greedy, -1.0, 1.0 / temperature.clamp_min(1e-5))


def philox_key(seed: int, device: torch.device) -> torch.Tensor:
    """The engine seed in the key's high half, the step counter (advanced by `key += 1`) in the low half."""
    return torch.tensor([(seed & 0x7FFFFFFF) << 32], dtype=torch.int64, device=device)
