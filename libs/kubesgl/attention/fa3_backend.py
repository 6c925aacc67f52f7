"""FlashAttention-3 through sgl-kernel's `flash_attn_with_kvcache` (Hopper only).

Not run in this project: the lent H200's image (torch 2.11, CUDA 13) has no matching sgl-kernel build.
Construction fails with a clear error wherever `sgl_kernel` is missing. The call mirrors Mini-SGLang's FA backend: varlen queries over
the paged cache, causal from the bottom right (query j of a request sees its prefix and new keys <= j).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.device_ints import exclusive_cumsum, to_device_int32
from kubesgl.attention.errors import BackendUnavailableError

if TYPE_CHECKING:
    from kubesgl.kv.kv_cache import KVCache


class FA3Attention:
    name = "fa3"

    def __init__(self, *, device: torch.device | str) -> None:
        try:
            from sgl_kernel.flash_attn import flash_attn_with_kvcache
        except ImportError as e:
            raise BackendUnavailableError(
                f"attention backend 'fa3' needs sgl-kernel (pip install sgl-kernel, Hopper GPU): {e}"
            ) from e
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise BackendUnavailableError(f"attention backend 'fa3' needs a CUDA device, not {self.device}")
        self._attn = flash_attn_with_kvcache
        self._meta: AttentionMetadata | None = None
        self._cu_seqlens_q = torch.empty(0)

    def plan(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._cu_seqlens_q = to_device_int32(exclusive_cumsum(list(meta.extend_lens)), self.device)

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        kv: KVCache,
        scale: float,
    ) -> torch.Tensor:
        meta = self._meta
        assert meta is not None, "plan() must run before forward()"
        return self._attn(
            q=q,
            k_cache=kv.k_pages(layer),
            v_cache=kv.v_pages(layer),
            page_table=meta.page_table,
            cache_seqlens=meta.seq_lens_dev,
            cu_seqlens_q=self._cu_seqlens_q,
            max_seqlen_q=max(meta.extend_lens),
            softmax_scale=scale,
            causal=True,
        )
