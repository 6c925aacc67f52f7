"""The always-available GPU attention backend: our own Triton kernels over the paged KV cache.

Decode runs split-KV (flash-decoding), so the few query heads sharing a kv head read each K/V byte once,
in one of two schedules. "split": one program per (request, kv head, slice), the number of slices depending
only on the batch size. "planned": a work list planned per step on the host from the sequence lengths
(`decode_plan.py`), near-equal items over a fixed grid per batch size, for ragged batches. Either way the
launch depends only on the batch size, which keeps a captured CUDA graph valid for any lengths at that size.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.decode_plan import (
    ITEM_INTS,
    MERGE_INTS,
    plan_decode_work,
    target_items,
    work_capacity,
)
from kubesgl.attention.device_ints import exclusive_cumsum, to_device_int32
from kubesgl.attention.errors import BackendUnavailableError

if TYPE_CHECKING:
    from kubesgl.kv.kv_cache import KVCache

MAX_DECODE_SPLITS = 16
LONG_SPLITS, LONG_SLICE = 4, 512  # large batches: requests over 512 tokens in up to 4 slices
DECODE_SCHEDULES = ("split", "planned")
# `--attn triton`; "triton-planned" / "triton-split" name one explicitly. Planned, 4 waves: on the H200 it read
# the KV at 4.25 TB/s on 256 ragged requests (split 3.78, FlashInfer 3.90), 4.17 on 256 x 850 (3.77 / 3.93) and
# led at 64 and 16 requests too (benchmark/results/kernel_bench_h200_session3.txt).
DEFAULT_DECODE_SCHEDULE = "planned"
PLAN_WAVES = 4.0  # planned schedule: about this many programs per multiprocessor per step (4 >= 8 > 16 > 32)


@dataclass
class _DecodePlan:
    page_table: torch.Tensor
    seq_lens: torch.Tensor
    partial_out: torch.Tensor | None  # [B, q_heads, S, D] float32 when S > 1
    partial_lse: torch.Tensor | None  # [B, q_heads, S] float32
    min_chunk: int  # shortest slice in tokens (decode_splits)


@dataclass
class _PlannedDecode:
    page_table: torch.Tensor
    work: torch.Tensor  # int32 DecodeWork.ints on the device
    capacity: int  # items in `work` (the grid is capacity x kv heads)
    partial_out: torch.Tensor  # [P, q_heads, D] float32
    partial_lse: torch.Tensor  # [P, q_heads] float32


@dataclass
class _ExtendPlan:
    page_table: torch.Tensor
    q_starts: torch.Tensor
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    tiles: torch.Tensor  # [2, n] int32: triton_kernels.extend_tiles


@dataclass
class _GraphBuffers:
    """Static inputs a captured decode graph reads; replay copies the real batch into them."""

    page_table: torch.Tensor  # [max_bs, max_pages]
    seq_lens: torch.Tensor  # [max_bs]
    partial_out: torch.Tensor  # flat, sized for the largest batch's splits (or planned partials)
    partial_lse: torch.Tensor
    work: torch.Tensor | None  # planned schedule: the largest batch's work list


def decode_splits(batch_size: int, num_kv_heads: int, num_sms: int) -> tuple[int, int]:
    """(slices per request, shortest slice in tokens) for a decode batch.

    A small batch cuts every request so that about two programs per multiprocessor are in flight. A batch
    that fills the device by itself cuts only its long requests, into slices of at least LONG_SLICE tokens:
    whole, a 2k-token request's program ran ~2.5x the average one and trailed the step (on the H200 the
    Triton kernel read equal-length batches at 4.1 TB/s but lost that lead to FlashInfer on ragged ones).
    """
    programs = batch_size * num_kv_heads
    wanted = -(-2 * num_sms // programs)
    if wanted > 1:
        return min(MAX_DECODE_SPLITS, wanted), 0
    return LONG_SPLITS, LONG_SLICE


def interpreter_active() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1 at kernel import)."""
    from triton.runtime.interpreter import InterpretedFunction

    from kubesgl.attention import triton_kernels

    return isinstance(triton_kernels._decode_split_kernel, InterpretedFunction)


class TritonAttention:
    """Paged decode and extend-with-prefix attention in Triton; KV is stored with `KVCache.store`."""

    name = "triton"
    cuda_graph_capable = True

    def __init__(
        self,
        *,
        device: torch.device | str,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        decode_block_n: int = 64,
        decode_num_warps: int = 4,
        decode_num_stages: int = 3,
        fixed_decode_splits: int | None = None,
        decode_schedule: str = DEFAULT_DECODE_SCHEDULE,
        plan_waves: float = PLAN_WAVES,
    ) -> None:
        """The decode_* knobs tune the split-KV kernels (defaults: best of benchmark/attention_bw.py's sweep on
        an H200); fixed_decode_splits overrides `decode_splits` (split schedule); plan_waves sizes the planned
        schedule's work list."""
        try:
            from kubesgl.attention import triton_kernels
        except ImportError as e:
            raise BackendUnavailableError(f"attention backend 'triton' needs the triton package: {e}") from e
        self.device = torch.device(device)
        if self.device.type != "cuda" and not interpreter_active():
            raise BackendUnavailableError(
                "attention backend 'triton' needs a CUDA device (or TRITON_INTERPRET=1 to run on the CPU)"
            )
        if num_q_heads % num_kv_heads:
            raise ValueError(f"num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        if decode_schedule not in DECODE_SCHEDULES:
            raise ValueError(
                f"decode schedule {decode_schedule!r}: choose one of {', '.join(DECODE_SCHEDULES)}"
            )
        self._kernels = triton_kernels
        self.decode_schedule = decode_schedule
        self.num_q_heads = num_q_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self._decode_cfg = {
            "block_n": decode_block_n,
            "num_warps": decode_num_warps,
            "num_stages": decode_num_stages,
        }
        self._num_sms = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 4
        )
        self._fixed_splits = fixed_decode_splits
        self._target_items = target_items(self._num_sms, num_kv_heads, plan_waves)
        self._plan: _DecodePlan | _PlannedDecode | _ExtendPlan | None = None
        self._graph: _GraphBuffers | None = None

    def plan(self, meta: AttentionMetadata) -> None:
        if meta.mode == "decode" and self.decode_schedule == "planned":
            self._plan = self._planned(meta.page_table, list(meta.seq_lens))
            return
        if meta.mode == "decode":
            self._plan = self._decode_plan(meta.page_table, meta.seq_lens_dev, meta.batch_size)
            return
        b = meta.batch_size
        q_starts = exclusive_cumsum(meta.extend_lens)[:b]
        tiles = self._kernels.extend_tiles(meta.prefix_lens, meta.extend_lens)
        ints = to_device_int32(
            q_starts + list(meta.prefix_lens) + list(meta.extend_lens) + tiles.ravel().tolist(), self.device
        )
        self._plan = _ExtendPlan(
            meta.page_table, ints[:b], ints[b : 2 * b], ints[2 * b : 3 * b], ints[3 * b :].view(2, -1)
        )

    def _split_policy(self, batch_size: int) -> tuple[int, int]:
        if self._fixed_splits:
            return self._fixed_splits, 0
        return decode_splits(batch_size, self.num_kv_heads, self._num_sms)

    def _decode_plan(
        self,
        page_table: torch.Tensor,
        seq_lens: torch.Tensor,
        batch_size: int,
        pool: _GraphBuffers | None = None,
    ) -> _DecodePlan:
        """The batch's split policy and its partial-result buffers (from the graph pool when given)."""
        splits, min_chunk = self._split_policy(batch_size)
        if splits == 1:
            return _DecodePlan(page_table, seq_lens, None, None, min_chunk)
        out_shape = (batch_size, self.num_q_heads, splits, self.head_dim)
        lse_shape = (batch_size, self.num_q_heads, splits)
        if pool is None:
            out = torch.empty(out_shape, dtype=torch.float32, device=self.device)
            lse = torch.empty(lse_shape, dtype=torch.float32, device=self.device)
        else:
            out = pool.partial_out[: math.prod(out_shape)].view(out_shape)
            lse = pool.partial_lse[: math.prod(lse_shape)].view(lse_shape)
        return _DecodePlan(page_table, seq_lens, out, lse, min_chunk)

    def _planned(
        self, page_table: torch.Tensor, seq_lens: list[int], pool: _GraphBuffers | None = None
    ) -> _PlannedDecode:
        """The step's work list on the device: a new tensor, or written into the graph pool's static one."""
        w = plan_decode_work(seq_lens, self._target_items, self._decode_cfg["block_n"])
        host = torch.from_numpy(w.ints)
        if pool is None:
            work = host.to(self.device)  # eager: a pageable copy of a few KB, like the batch's other inputs
            parts = max(1, w.num_partials)
            out = torch.empty(
                (parts, self.num_q_heads, self.head_dim), dtype=torch.float32, device=self.device
            )
            lse = torch.empty((parts, self.num_q_heads), dtype=torch.float32, device=self.device)
            return _PlannedDecode(page_table, work, w.capacity, out, lse)
        assert pool.work is not None
        work = pool.work[: host.numel()]
        if self.device.type == "cuda":  # pinned, so the host does not wait for the step in flight
            work.copy_(host.pin_memory(), non_blocking=True)
        else:
            work.copy_(host)
        parts = pool.partial_lse.numel() // self.num_q_heads
        out = pool.partial_out.view(parts, self.num_q_heads, self.head_dim)
        lse = pool.partial_lse.view(parts, self.num_q_heads)
        return _PlannedDecode(page_table, work, w.capacity, out, lse)

    def forward(
        self,
        q: torch.Tensor,
        layer: int,
        kv: KVCache,
        scale: float,
    ) -> torch.Tensor:
        plan = self._plan
        assert plan is not None, "plan() must run before forward()"
        out = torch.empty_like(q)
        k_cache, v_cache = kv.k_pages(layer), kv.v_pages(layer)
        if isinstance(plan, _PlannedDecode):
            from kubesgl.attention.triton_planned import planned_decode_attention

            return planned_decode_attention(
                q,
                k_cache,
                v_cache,
                plan.page_table,
                plan.work,
                plan.capacity,
                out,
                scale,
                plan.partial_out,
                plan.partial_lse,
                **self._decode_cfg,
            )
        if isinstance(plan, _DecodePlan):
            return self._kernels.decode_attention(
                q,
                k_cache,
                v_cache,
                plan.page_table,
                plan.seq_lens,
                out,
                scale,
                plan.partial_out,
                plan.partial_lse,
                min_chunk=plan.min_chunk,
                **self._decode_cfg,
            )
        return self._kernels.extend_attention(
            q,
            k_cache,
            v_cache,
            plan.page_table,
            plan.q_starts,
            plan.prefix_lens,
            plan.extend_lens,
            plan.tiles,
            out,
            scale,
        )

    # CUDA-graph hooks (decode only): the runner calls init once, plan_capture before capturing batch
    # size `bs`, and plan_replay before each replay at `bs` (the real batch padded up to it).

    def init_cuda_graph(self, max_bs: int, max_pages: int) -> None:
        work = None
        if self.decode_schedule == "planned":
            # Partials never outnumber items; the work list holds the largest batch's items and merge rows.
            most = work_capacity(max_bs, self._target_items)
            work = torch.zeros(ITEM_INTS * most + MERGE_INTS * max_bs, dtype=torch.int32, device=self.device)
        else:
            most = max(bs * self._split_policy(bs)[0] for bs in range(1, max_bs + 1))
        self._graph = _GraphBuffers(
            page_table=torch.zeros((max_bs, max_pages), dtype=torch.int32, device=self.device),
            seq_lens=torch.ones(max_bs, dtype=torch.int32, device=self.device),
            partial_out=torch.empty(
                most * self.num_q_heads * self.head_dim, dtype=torch.float32, device=self.device
            ),
            partial_lse=torch.empty(most * self.num_q_heads, dtype=torch.float32, device=self.device),
            work=work,
        )

    def plan_capture(self, bs: int) -> None:
        g = self._graph_buffers(bs)
        if self.decode_schedule == "planned":  # a placeholder plan; replays write the real one in place
            self._plan = self._planned(g.page_table[:bs], [1] * bs, g)
        else:
            self._plan = self._decode_plan(g.page_table[:bs], g.seq_lens[:bs], bs, g)

    def plan_replay(self, meta: AttentionMetadata, bs: int) -> None:
        g = self._graph_buffers(bs)
        n, width = meta.batch_size, meta.page_table.shape[1]
        if meta.mode != "decode" or n > bs or width > g.page_table.shape[1]:
            raise ValueError(
                f"cannot replay a {meta.mode} batch of {n} x {width} pages in a graph of {bs} x {g.page_table.shape[1]}"
            )
        g.page_table[:n, :width].copy_(meta.page_table, non_blocking=True)
        g.seq_lens[:n].copy_(meta.seq_lens_dev, non_blocking=True)
        # Padding rows attend one token in the scratch page 0, where padded tokens also write.
        g.page_table[n:bs, 0].zero_()
        g.seq_lens[n:bs].fill_(1)
        if self.decode_schedule == "planned":
            self._plan = self._planned(g.page_table[:bs], list(meta.seq_lens) + [1] * (bs - n), g)
        else:
            self.plan_capture(bs)

    def _graph_buffers(self, bs: int) -> _GraphBuffers:
        if self._graph is None or bs > self._graph.seq_lens.shape[0]:
            raise ValueError(
                f"batch size {bs} is outside the CUDA-graph buffers (call init_cuda_graph first)"
            )
        return self._graph
