"""Tensor-parallel process group handle, passed explicitly to every layer that shards (no globals)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its tensor-parallel group.

    `group` carries tensors (NCCL on GPU, gloo on CPU); `cpu_group` carries control messages (gloo).
    With size 1 every collective is the identity and no process group exists. Ranks may span nodes
    (EngineConfig.nnodes): `rank` is global, `local_rank` picks the GPU on this node.
    """

    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None
    cpu_group: dist.ProcessGroup | None = None
    local_rank: int | None = None  # this rank's device on its node (multi-node TP); None: the same as rank

    @property
    def device_index(self) -> int:
        return self.rank if self.local_rank is None else self.local_rank

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenates each rank's `x` along `dim`, in rank order."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` into every rank's `x` (same shape and dtype everywhere), over the tensor group."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0 sends `obj` over the CPU group; every rank returns it."""
        if self.size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]


def shard_range(total: int, tp: TPGroup) -> tuple[int, int]:
    """[start, end) of this rank's even share of `total` (which must divide evenly)."""
    if total % tp.size:
        raise ValueError(f"dimension {total} is not divisible by tp_size {tp.size}")
    per = total // tp.size
    return tp.rank * per, (tp.rank + 1) * per
