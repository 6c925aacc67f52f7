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

# Each program scans SPLIT logits of one row in BLOCK-wide chunks; a second kernel picks each row's best split,
# so even a batch of one row is read by many programs at once (docs/performance.md has the figures). A batch
# with fewer than MIN_PROGRAMS programs at SPLIT takes one block per program instead: Philox, not memory,
# bounds the scan, and at one row 19 programs of 8192 logits took 14 us on the H100. A vocabulary smaller
# than SPLIT is scanned in as many blocks as it fills. The noise of a logit depends only on its column, not on
# the split, so every choice draws the same tokens.
SPLIT = 8192
BLOCK = 2048
MIN_PROGRAMS = 128


@triton.jit
def _scan_quarter(logits_ptr, row_off, start, vocab, scale, u, best_val, best_idx, Q: tl.constexpr):
    """Lane j keeps the best score of the columns start + j it has seen: elementwise, no reduction."""
    cols = start + tl.arange(0, Q)
    mask = cols < vocab
    logit = tl.load(logits_ptr + row_off + cols, mask=mask, other=float("-inf")).to(tl.float32)
    score = tl.where(scale < 0, logit, logit * scale - tl.log(-tl.log(u)))
    score = tl.where(mask, score, float("-inf"))
    # Strictly greater: a lane sees its columns in increasing order, so the first one wins a tie.
    take = score > best_val
    return tl.where(take, cols, best_idx), tl.where(take, score, best_val)


@triton.jit
def _gumbel_partial_kernel(
    logits_ptr,
    stride,
    scale_ptr,
    key_ptr,
    part_val_ptr,
    part_idx_ptr,
    vocab,
    groups,
    n_splits,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
    Q: tl.constexpr,
):
    """One Philox call (rand4x) draws the noise of four logits, a quarter-block apart: with one call per logit
    the generator, not the memory, bounds the kernel. Each lane keeps a running best over its columns and the
    program reduces once at the end (a max and an argmax per quarter cost more than the scan at large batch):
    the largest score, the lowest column among lanes that hold it, as torch.argmax breaks ties."""
    row = tl.program_id(0)
    split = tl.program_id(1)
    scale = tl.load(scale_ptr + row)
    key = tl.load(key_ptr)
    row_off = row.to(tl.int64) * stride
    best_val = tl.full([Q], float("-inf"), tl.float32)
    best_idx = tl.full([Q], 0, tl.int32)
    lo = split * SPLIT
    for off in range(0, SPLIT, BLOCK):
        base = lo + off
        q = tl.arange(0, Q)
        # Counter row * groups + base / 4 + q: blocks of a row take disjoint runs of Q counters and rows
        # disjoint runs of `groups`, so every logit of the batch gets its own draw.
        u0, u1, u2, u3 = tl.rand4x(key, row * groups + base // 4 + q)
        best_idx, best_val = _scan_quarter(logits_ptr, row_off, base, vocab, scale, u0, best_val, best_idx, Q)
        best_idx, best_val = _scan_quarter(
            logits_ptr, row_off, base + Q, vocab, scale, u1, best_val, best_idx, Q
        )
        best_idx, best_val = _scan_quarter(
            logits_ptr, row_off, base + 2 * Q, vocab, scale, u2, best_val, best_idx, Q
        )
        best_idx, best_val = _scan_quarter(
            logits_ptr, row_off, base + 3 * Q, vocab, scale, u3, best_val, best_idx, Q
        )
    top = tl.max(best_val, 0)
    # A split whose every score is -inf (masked columns) reports column 0 (no lane took a column): the pick
    # kernel never takes it over a finite score.
    idx = tl.min(tl.where(best_val == top, best_idx, 2147483647), 0)
    at = row * n_splits + split
    tl.store(part_val_ptr + at, top)
    tl.store(part_idx_ptr + at, idx)


@triton.jit
def _gumbel_pick_kernel(part_val_ptr, part_idx_ptr, out_ptr, n_splits, BLOCK_S: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK_S)
    vals = tl.load(part_val_ptr + row * n_splits + offs, mask=offs < n_splits, other=float("-inf"))
    best = tl.argmax(vals, 0)  # the first split holding the maximum: ties still go to the lowest index
    idx = tl.load(part_idx_ptr + row * n_splits + best)
    tl.store(out_ptr + row, idx.to(tl.int64))


def scan_split(batch: int, vocab: int) -> int:
    """Logits per program: SPLIT where the batch makes MIN_PROGRAMS programs of SPLIT, else one BLOCK; never more
    blocks than the vocabulary fills."""
    split = SPLIT if batch * triton.cdiv(vocab, SPLIT) >= MIN_PROGRAMS else BLOCK
    return min(split, triton.cdiv(vocab, BLOCK) * BLOCK)


def gumbel_tokens(
    logits: torch.Tensor, scale: torch.Tensor, key: torch.Tensor, split: int | None = None
) -> torch.Tensor:
    """logits [B, V] (any float dtype, rows contiguous); scale [B] float32 = 1 / T, or -1 for greedy rows;
    key [1] int64 Philox key (advance it between steps). Returns the tokens [B] int64. `split` (a multiple
    of BLOCK) overrides `scan_split`'s logits per program; the tokens do not depend on it."""
    b, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if split is None:
        split = scan_split(b, vocab)
    if split <= 0 or split % BLOCK:
        raise ValueError(f"split {split} must be a positive multiple of {BLOCK}")
    n_splits = triton.cdiv(vocab, split)
    part_val = torch.empty((b, n_splits), dtype=torch.float32, device=logits.device)
    part_idx = torch.empty((b, n_splits), dtype=torch.int32, device=logits.device)
    _gumbel_partial_kernel[(b, n_splits)](
        logits,
        logits.stride(0),
        scale,
        key,
        part_val,
        part_idx,
        vocab,
        triton.cdiv(vocab, BLOCK) * (BLOCK // 4),  # counters per row: one per 4 logits of each block
        n_splits,
        SPLIT=split,
        BLOCK=BLOCK,
        Q=BLOCK // 4,
        num_warps=4,
    )
    _gumbel_pick_kernel[(b,)](part_val, part_idx, out, n_splits, BLOCK_S=triton.next_power_of_2(n_splits))
    return out


def sampling_scale(temperature: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """Per row 1 / T, or -1 where the row is greedy."""
    return torch.where(greedy, -1.0, 1.0 / temperature.clamp_min(1e-5))


def philox_key(seed: int, device: torch.device) -> torch.Tensor:
    """The engine seed in the key's high half, the step counter (advanced by `key += 1`) in the low half."""
    return torch.tensor([(seed & 0x7FFFFFFF) << 32], dtype=torch.int64, device=device)
