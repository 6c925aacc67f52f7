"""CUDA graphs for decode: one graph per captured batch size, all sharing one memory pool.

A decode batch of n requests replays the smallest captured size >= n; the padded rows read token 0 at
position 0 and write their KV to the scratch page 0, and their logits are dropped.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.graph_hooks import supports_cuda_graph
from kubesgl.engine.forward import ForwardBatch

if TYPE_CHECKING:
    from kubesgl.engine.runner import ModelRunner

log = logging.getLogger(__name__)


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def auto_max_bs(device: torch.device, max_running: int) -> int:
    """Mini-SGLang's default: 256 on a card of more than 80 GiB, else 160; never above max_running_requests.

    Judged on the card's size: by capture time the KV pool has already taken the free memory."""
    _, total = torch.cuda.mem_get_info(device)
    return min(256 if total > 80 * 2**30 else 160, max_running)


class DecodeGraphs:
    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        if not supports_cuda_graph(runner.attn):
            raise ValueError(f"attention backend {type(runner.attn).__name__} cannot run in CUDA graphs")
        self.runner = runner
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        dev = runner.device
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        runner.attn.init_cuda_graph(self.max_bs, runner.page_table.shape[1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            graph, out = self._capture(bs, pool)
            pool = graph.pool()
            self.graphs[bs], self.logits[bs] = graph, out
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured %d decode CUDA graphs (bs <= %d) in %.1f s",
            len(self.sizes),
            self.max_bs,
            self.capture_seconds,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        r = self.runner
        fb = ForwardBatch("decode", self.input_ids[:bs], self.positions[:bs], self.out_loc[:bs], r.attn, r.kv)
        return r.model.compute_logits(r.model.forward(fb)).float()

    def _capture(self, bs: int, pool: object) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        self.runner.attn.plan_capture(bs)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm up: autotuning and lazy allocations must not happen inside capture
                self._forward(bs)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self._forward(bs)
        return graph, out

    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        out_loc: torch.Tensor,
        meta: AttentionMetadata,
        bs: int,
    ) -> torch.Tensor:
        n = input_ids.shape[0]
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.out_loc[:n].copy_(out_loc)
        if bs > n:
            self.input_ids[n:bs].zero_()
            self.positions[n:bs].zero_()
            self.out_loc[n:bs].zero_()
        self.runner.attn.plan_replay(meta, bs)
        self.graphs[bs].replay()
        return self.logits[bs][:n]
