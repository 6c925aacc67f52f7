"""`--attn prefill,decode`: one backend for extend batches, another for decode batches."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kubesgl.attention.base import AttentionBackend, AttentionMetadata
from kubesgl.attention.graph_hooks import CudaGraphAttention

if TYPE_CHECKING:
    from kubesgl.kv.kv_cache import KVCache


class HybridAttention:
    """Routes each batch by its mode; CUDA-graph hooks (decode only) go to the decode backend."""

    def __init__(self, extend: AttentionBackend, decode: AttentionBackend) -> None:
        self.extend_backend = extend
        self.decode_backend = decode
        self.name = f"{getattr(extend, 'name', '?')},{getattr(decode, 'name', '?')}"
        self.cuda_graph_capable: bool = getattr(decode, "cuda_graph_capable", False)
        self._active: AttentionBackend = decode

    def plan(self, meta: AttentionMetadata) -> None:
        self._active = self.decode_backend if meta.mode == "decode" else self.extend_backend
        self._active.plan(meta)

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        kv: KVCache,
        scale: float,
    ) -> torch.Tensor:
        return self._active.forward(q, layer, kv, scale)

    def init_cuda_graph(self, max_bs: int, max_pages: int) -> None:
        self._graph_backend().init_cuda_graph(max_bs, max_pages)

    def plan_capture(self, bs: int) -> None:
        self._active = self._graph_backend()
        self._active.plan_capture(bs)

    def plan_replay(self, meta: AttentionMetadata, bs: int) -> None:
        self._active = self._graph_backend()
        self._active.plan_replay(meta, bs)

    def _graph_backend(self) -> CudaGraphAttention:
        if not self.cuda_graph_capable:
            raise ValueError(f"decode backend {self.name.split(',')[1]!r} does not support CUDA graphs")
        return self.decode_backend  # type: ignore[return-value]
