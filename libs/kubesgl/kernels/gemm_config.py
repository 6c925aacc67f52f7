"""The mid-batch GEMM kernel's launch config (`gemm_triton`), importable without Triton."""

from __future__ import annotations

import re
from dataclasses import dataclass

_KEY = re.compile(r"m(\d+)n(\d+)k(\d+)s(\d+)w(\d+)p(\d+)")


@dataclass(frozen=True)
class GemmConfig:
    """Tile sizes (rows of x, rows of w, K per step), K splits, warps and pipeline stages of one launch."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3

    def key(self) -> str:
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split_k}w{self.num_warps}p{self.num_stages}"
        )

    @classmethod
    def parse(cls, key: str) -> GemmConfig:
        """The inverse of `key` (the sweep's JSON names configs so)."""
        match = _KEY.fullmatch(key)
        if match is None:
            raise ValueError(f"not a GEMM config key: {key!r} (e.g. 'm16n64k128s1w4p3')")
        return cls(*(int(v) for v in match.groups()))
