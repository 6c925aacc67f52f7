"""The paged KV store: per layer, one K and one V buffer of shape [num_pages, page_size, kv_heads, head_dim]."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class KVCache:
    """Physical KV memory for this rank (kv_heads is the per-rank share under TP).

    Page 0 is reserved as a scratch page: padded tokens (CUDA graph padding) write there, so it is
    never handed out by the PagePool.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (num_layers, num_pages, page_size, num_kv_heads, head_dim)
        self._k = torch.zeros(shape, dtype=dtype, device=self.device)
        self._v = torch.zeros(shape, dtype=dtype, device=self.device)

    def k_pages(self, layer: int) -> torch.Tensor:
        """[num_pages, page_size, kv_heads, head_dim] view of layer `layer`'s keys."""
        return self._k[layer]

    def v_pages(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def k_flat(self, layer: int) -> torch.Tensor:
        """[num_pages * page_size, kv_heads, head_dim]: one row per token slot."""
        return self._k[layer].view(-1, self.num_kv_heads, self.head_dim)

    def v_flat(self, layer: int) -> torch.Tensor:
        return self._v[layer].view(-1, self.num_kv_heads, self.head_dim)

    def store(self, layer: int, out_loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Writes new tokens' K/V ([T, kv_heads, head_dim]) to their slots."""
        self.k_flat(layer)[out_loc] = k.to(self.dtype)
        self.v_flat(layer)[out_loc] = v.to(self.dtype)

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V tensors whole (a transfer engine registers them once)."""
        return self._k, self._v

    @property
    def page_bytes(self) -> int:
        """Bytes of one page of one layer's K (or V)."""
        return self.page_size * self.num_kv_heads * self.head_dim * self._k.element_size()

    def layout(self) -> KvLayout:
        """Where this cache's pages lie in memory (what a peer needs to address them)."""
        dev = (self.device.index or 0) if self.device.type == "cuda" else 0
        bases = (self._k.data_ptr(), self._v.data_ptr())
        return KvLayout(dev, self.num_layers, self.num_pages, self.page_bytes, bases)

    @staticmethod
    def bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class KvLayout:
    """A KV cache's place in memory: per buffer (K, V) a base address, then `num_layers` rows of `num_pages`
    pages of `page_bytes` each. Two caches of one model and page size differ only in bases and pool size."""

    device: int
    num_layers: int
    num_pages: int
    page_bytes: int
    bases: tuple[int, int]  # K, V

    def run_regions(self, runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """(address, bytes) of each run of consecutive pages (first page, count) in every layer, K then V,
        layer-major: the same order for any two layouts of one model, so two run lists of the same lengths
        pair region by region."""
        stride = self.num_pages * self.page_bytes
        return [
            (base + layer * stride + first * self.page_bytes, count * self.page_bytes)
            for base in self.bases
            for layer in range(self.num_layers)
            for first, count in runs
        ]
