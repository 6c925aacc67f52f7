"""FlashInfer attention: paged prefill with a cached prefix, paged decode, and CUDA-graph decode.

All scheduling work happens in `plan` (once per batch, on the host, from host-side lengths); `forward`
only launches kernels. FlashInfer takes the page table as a ragged list (indptr + indices), which
`flatten_page_table` builds on the device without a host sync.
"""

from __future__ import annotations

import builtins
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.device_ints import exclusive_cumsum, to_device_int32
from kubesgl.attention.errors import BackendUnavailableError

if TYPE_CHECKING:
    from kubesgl.kv.kv_cache import KVCache

WORKSPACE_BYTES = 256 << 20


def flatten_page_table(page_table: torch.Tensor, num_pages: list[int]) -> torch.Tensor:
    """Concatenates page_table[i, :num_pages[i]] over the batch (output size known on the host)."""
    total = sum(num_pages)
    counts = to_device_int32(num_pages, page_table.device)
    rows = torch.repeat_interleave(
        torch.arange(len(num_pages), device=page_table.device), counts, output_size=total
    )
    cols = torch.arange(total, device=page_table.device) - (torch.cumsum(counts, 0) - counts)[rows]
    return page_table[rows, cols]


def _tensor_aware_max(*args: Any, **kwargs: Any) -> Any:
    """builtins.max, except that a non-empty 1-D tensor answers with its own max (one op, same value)."""
    one = args[0] if len(args) == 1 and not kwargs else None
    if isinstance(one, torch.Tensor) and one.dim() == 1 and one.numel():
        return one.max()
    return builtins.max(*args, **kwargs)


def speed_up_host_max(module: ModuleType) -> None:
    """FlashInfer's tensor-core decode plan takes `max()` of a host tensor of KV lengths on every plan; the
    builtin walks it element by element (0.9 ms for 256 requests on our CI CPU), the tensor's max is one op."""
    module.max = _tensor_aware_max  # type: ignore[attr-defined]


def _pinned_int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, pin_memory=True)


class FlashInferAttention:
    """FlashInfer 0.5 wrappers over our [num_pages, page_size, kv_heads, head_dim] (NHD) cache.

    The softmax scale is part of FlashInfer's plan, so it is fixed at construction.
    """

    name = "flashinfer"
    cuda_graph_capable = True

    def __init__(
        self,
        *,
        device: torch.device | str,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        scale: float | None = None,
        use_tensor_cores: bool | None = None,
    ) -> None:
        try:
            import flashinfer
        except ImportError as e:
            raise BackendUnavailableError(
                f"attention backend 'flashinfer' needs the flashinfer package: {e}"
            ) from e
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise BackendUnavailableError(
                f"attention backend 'flashinfer' needs a CUDA device, not {self.device}"
            )
        self._fi = flashinfer
        speed_up_host_max(flashinfer.decode)
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.page_size, self.dtype = page_size, dtype
        self.scale = head_dim**-0.5 if scale is None else scale
        # Tensor-core decode for any GQA: on an H200 at Qwen3-0.6B shapes (2 q heads per kv head) it read
        # ragged KV at 3.71 TB/s against 3.33 for the CUDA-core kernel (benchmark/attention_bw.py).
        gqa = num_q_heads > num_kv_heads
        self.use_tensor_cores = gqa if use_tensor_cores is None else use_tensor_cores
        self._workspace = torch.zeros(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        # FlashInfer's FA3 path is slower than FA2 for this use (Mini-SGLang's finding) and needs its own JIT.
        self._prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(self._workspace, "NHD", backend="fa2")
        self._decode = self._decode_wrapper()
        self._active: Any = None
        self._graph_buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._graph_wrappers: dict[int, Any] = {}
        self._plan_copied: torch.cuda.Event | None = None

    def _decode_wrapper(self, graph_bs: int | None = None) -> Any:
        if graph_bs is None:
            return self._fi.BatchDecodeWithPagedKVCacheWrapper(
                self._workspace, "NHD", use_tensor_cores=self.use_tensor_cores
            )
        assert self._graph_buffers is not None, "init_cuda_graph() must run first"
        indptr, indices, last_page_len = self._graph_buffers
        return self._fi.BatchDecodeWithPagedKVCacheWrapper(
            self._workspace,
            "NHD",
            use_cuda_graph=True,
            use_tensor_cores=self.use_tensor_cores,
            paged_kv_indptr_buffer=indptr[: graph_bs + 1],
            paged_kv_indices_buffer=indices,
            paged_kv_last_page_len_buffer=last_page_len[:graph_bs],
        )

    def plan(self, meta: AttentionMetadata) -> None:
        self._plan(meta, self._decode if meta.mode == "decode" else self._prefill, meta.batch_size)

    def _plan(self, meta: AttentionMetadata, wrapper: Any, padded_bs: int) -> None:
        """Plans `meta`, padded to `padded_bs` rows that each attend one token of the scratch page 0."""
        pad = padded_bs - meta.batch_size
        ps = self.page_size
        num_pages = [-(-n // ps) for n in meta.seq_lens]
        indptr = _pinned_int32(exclusive_cumsum(num_pages + [1] * pad))
        last_page_len = _pinned_int32(
            [n - (p - 1) * ps for n, p in zip(meta.seq_lens, num_pages, strict=True)] + [1] * pad
        )
        indices = flatten_page_table(meta.page_table, num_pages)
        if pad:
            indices = torch.cat([indices, torch.zeros(pad, dtype=indices.dtype, device=indices.device)])
        # KV lengths in a pinned host tensor: FlashInfer then neither rebuilds them from indptr and
        # last_page_len on the host nor copies them to its buffer from pageable memory.
        common: dict[str, Any] = {
            "sm_scale": self.scale,
            "q_data_type": self.dtype,
            "kv_data_type": self.dtype,
            "seq_lens": _pinned_int32(list(meta.seq_lens) + [1] * pad),
        }
        # FlashInfer stages plan data in one pinned buffer per wrapper and copies it asynchronously: wait
        # until the previous plan's copy has run (the start of the batch in flight) before overwriting it.
        if self._plan_copied is not None:
            self._plan_copied.synchronize()
        if wrapper is self._prefill:
            qo_indptr = _pinned_int32(exclusive_cumsum(list(meta.extend_lens)))
            wrapper.plan(
                qo_indptr,
                indptr,
                indices,
                last_page_len,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                causal=True,
                **common,
            )
        else:
            wrapper.plan(
                indptr,
                indices,
                last_page_len,
                self.num_q_heads,
                self.num_kv_heads,
                self.head_dim,
                ps,
                **common,
            )
        self._plan_copied = torch.cuda.Event()
        self._plan_copied.record()
        self._active = wrapper

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        kv: KVCache,
        scale: float,
    ) -> torch.Tensor:
        assert self._active is not None, "plan() must run before forward()"
        if abs(scale - self.scale) > 1e-9 * self.scale:
            raise ValueError(
                f"FlashInfer was planned with softmax scale {self.scale}, the layer asks {scale}"
            )
        return self._active.run(q.contiguous(), (kv.k_pages(layer), kv.v_pages(layer)))

    # CUDA-graph hooks (decode only): init once; plan_capture(bs) before capturing batch size bs (not
    # inside the capture: planning copies from the host); plan_replay(meta, bs) before each replay.

    def init_cuda_graph(self, max_bs: int, max_pages: int) -> None:
        self._graph_buffers = (
            torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device),
            torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device),
            torch.zeros(max_bs, dtype=torch.int32, device=self.device),
        )
        self._graph_wrappers = {}

    def plan_capture(self, bs: int) -> None:
        if bs not in self._graph_wrappers:
            self._graph_wrappers[bs] = self._decode_wrapper(graph_bs=bs)
        # A placeholder batch of one-token requests in the scratch page; replays plan the real one.
        seq_lens = [1] * bs
        dummy = AttentionMetadata(
            mode="decode",
            page_size=self.page_size,
            seq_lens=seq_lens,
            extend_lens=seq_lens,
            prefix_lens=[0] * bs,
            page_table=torch.zeros((bs, 1), dtype=torch.int32, device=self.device),
            seq_lens_dev=torch.ones(bs, dtype=torch.int32, device=self.device),
        )
        self._plan(dummy, self._graph_wrappers[bs], bs)

    def plan_replay(self, meta: AttentionMetadata, bs: int) -> None:
        wrapper = self._graph_wrappers.get(bs)
        if wrapper is None or meta.mode != "decode" or meta.batch_size > bs:
            raise ValueError(
                f"no captured decode graph of batch size {bs} for a {meta.mode} batch of {meta.batch_size}"
            )
        self._plan(meta, wrapper, bs)
