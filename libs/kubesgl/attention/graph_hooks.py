"""The CUDA-graph side of a decode attention backend, for the model runner.

    backend.init_cuda_graph(max_bs, max_pages)   # once: static buffers shared by every graph
    backend.plan_capture(bs)                     # before capturing batch size bs (outside the capture)
    backend.plan_replay(meta, bs)                # before each replay: the real batch, padded up to bs

Padded rows attend one token in the scratch page 0, where the runner points padded tokens' out_loc.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kubesgl.attention.base import AttentionBackend, AttentionMetadata


@runtime_checkable
class CudaGraphAttention(Protocol):
    cuda_graph_capable: bool

    def init_cuda_graph(self, max_bs: int, max_pages: int) -> None: ...

    def plan_capture(self, bs: int) -> None: ...

    def plan_replay(self, meta: AttentionMetadata, bs: int) -> None: ...


def supports_cuda_graph(backend: AttentionBackend) -> bool:
    """True when decode batches of this backend can be captured and replayed."""
    return bool(getattr(backend, "cuda_graph_capable", False))
