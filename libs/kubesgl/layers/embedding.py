"""Vocabulary-parallel token embedding and LM head (each rank holds a contiguous slice of the vocab)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from kubesgl.distributed import TPGroup
from kubesgl.layers.linear import copy_checked, make_param


def padded_vocab(vocab_size: int, tp: TPGroup) -> int:
    """The vocab rounded up so every rank holds the same number of rows (padding rows stay zero)."""
    return -(-vocab_size // tp.size) * tp.size


class VocabParallelEmbedding(nn.Module):
    """Embedding lookup where each rank owns rows [start, end); other ids contribute zeros to the all-reduce."""

    def __init__(self, vocab_size: int, hidden_size: int, *, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.per_rank = padded_vocab(vocab_size, tp) // tp.size
        self.start = tp.rank * self.per_rank
        self.weight = make_param((self.per_rank, hidden_size), self._load)

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        if full.shape[0] != self.vocab_size:
            raise ValueError(f"embedding has {full.shape[0]} rows, config vocab_size is {self.vocab_size}")
        rows = full[self.start : self.start + self.per_rank]
        param.data.zero_()
        copy_checked(param.data[: rows.shape[0]], rows, "vocab-parallel embedding")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside[:, None], 0)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocab on every rank (local slice, then all-gather)."""

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        """Shares the input embedding's weight (tie_word_embeddings); both use the same vocab split."""
        self.weight = embedding.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the weight's dtype: samplers read them once and cast what they keep (a float32 copy of
        the whole batch would cost every decode step a pass over [B, vocab])."""
        logits = F.linear(hidden, self.weight)
        logits = self.tp.all_gather(logits, dim=-1)
        return logits[:, : self.vocab_size]
