"""Tensor-parallel linear layers; each loads the full HF tensor and keeps this rank's shard.

Column-parallel layers split the output dim (no communication); row-parallel layers split the input
dim and all-reduce the partial sums. Every parameter carries a `weight_loader(param, full, shard_id)`
and a `num_shards` (how many checkpoint tensors fill it) so the loader can tell when one is missing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from kubesgl.distributed import TPGroup, shard_range
from kubesgl.kernels.gemv import linear

WeightLoader = Callable[[nn.Parameter, torch.Tensor, Any], None]


def make_param(
    shape: Sequence[int], loader: WeightLoader, num_shards: int = 1, *, dtype: torch.dtype | None = None
) -> nn.Parameter:
    """An uninitialised inference parameter tagged with how the checkpoint loader fills it."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader  # type: ignore[attr-defined]
    param.num_shards = num_shards  # type: ignore[attr-defined]
    return param


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """Copies `src` into `dst` (any dtype/device), refusing a shape mismatch with a readable error."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)


def load_full(param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
    """Loader for a replicated parameter: the checkpoint tensor is copied as is."""
    copy_checked(param.data, full, "replicated weight")


def _narrow_rank(full: torch.Tensor, dim: int, tp: TPGroup) -> torch.Tensor:
    start, end = shard_range(full.shape[dim], tp)
    return full.narrow(dim, start, end - start)


class _ColumnParallel(nn.Module):
    """A column-parallel projection: this rank's output columns, no communication."""

    weight: nn.Parameter
    bias: nn.Parameter | None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(_ColumnParallel):
    """Several column-parallel projections of the same input in one matmul (gate_proj + up_proj).

    Each rank holds [shard of output 0 | shard of output 1 | ...]; shard_id is the output's index.
    """

    def __init__(self, in_features: int, out_features: Sequence[int], *, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.sizes = [shard_range(n, tp)[1] - shard_range(n, tp)[0] for n in out_features]
        total = sum(self.sizes)
        self.weight = make_param((total, in_features), self._load, len(self.sizes))
        self.bias = make_param((total,), self._load, len(self.sizes)) if bias else None

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: int) -> None:
        offset = sum(self.sizes[:shard_id])
        dst = param.data.narrow(0, offset, self.sizes[shard_id])
        copy_checked(dst, _narrow_rank(full, 0, self.tp), f"merged-column weight part {shard_id}")


def kv_heads_per_rank(num_kv_heads: int, tp: TPGroup) -> int:
    """This rank's KV heads: an even split, or one replicated head when there are fewer heads than ranks."""
    if num_kv_heads >= tp.size:
        if num_kv_heads % tp.size:
            raise ValueError(f"{num_kv_heads} KV heads cannot be split over tp_size {tp.size}")
        return num_kv_heads // tp.size
    if tp.size % num_kv_heads:
        raise ValueError(f"tp_size {tp.size} is not a multiple of the {num_kv_heads} KV heads")
    return 1


class QKVParallelLinear(_ColumnParallel):
    """Fused q/k/v projection split by heads; KV heads are replicated when tp_size exceeds them."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        *,
        bias: bool,
        tp: TPGroup,
    ) -> None:
        super().__init__()
        if num_heads % tp.size:
            raise ValueError(f"{num_heads} attention heads cannot be split over tp_size {tp.size}")
        self.tp = tp
        self.head_dim = head_dim
        self.num_heads = num_heads // tp.size
        self.num_kv_heads = kv_heads_per_rank(num_kv_heads, tp)
        # With replication, ranks rank*kv/tp .. share one head: rank r keeps head r * kv // tp.
        self.kv_head_start = tp.rank * num_kv_heads // tp.size
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        total = self.q_size + 2 * self.kv_size
        self.weight = make_param((total, hidden_size), self._load, 3)
        self.bias = make_param((total,), self._load, 3) if bias else None

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: str) -> None:
        d = self.head_dim
        if shard_id == "q":
            offset, size, src_start = 0, self.q_size, self.tp.rank * self.q_size
        else:
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            size, src_start = self.kv_size, self.kv_head_start * d
        dst = param.data.narrow(0, offset, size)
        copy_checked(dst, full.narrow(0, src_start, size), f"qkv weight part {shard_id}")


class RowParallelLinear(nn.Module):
    """y = x W^T + b with W's input columns split over ranks; partial sums are all-reduced."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        start, end = shard_range(in_features, tp)
        self.weight = make_param((out_features, end - start), self._load)
        self.bias = make_param((out_features,), load_full) if bias else None

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: Any = None) -> None:
        copy_checked(param.data, _narrow_rank(full, 1, self.tp), "row-parallel weight")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(linear(x, self.weight))
        # Bias after the reduce so it is added once, not tp_size times.
        return y if self.bias is None else y + self.bias
