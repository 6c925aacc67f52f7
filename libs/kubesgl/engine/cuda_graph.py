"""CUDA graphs for decode: one graph per captured batch size, all sharing one memory pool.

A decode batch of n requests replays the smallest captured size >= n; the padded rows name the scratch
slot (token pool row and page-table row of its own, all pages 0), so they read token 0 at position 0 and
write their KV to the scratch page 0; their logits and tokens are dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import NamedTuple

import torch

from kubesgl.attention.base import AttentionBackend, AttentionMetadata
from kubesgl.attention.graph_hooks import supports_cuda_graph
from kubesgl.engine.compile import CompiledForward
from kubesgl.engine.decode_inputs import decode_inputs
from kubesgl.engine.gumbel_sampling import gumbel_tokens, philox_key, sampling_scale
from kubesgl.engine.sampler import Sampler, greedy_tokens, temperature_tokens
from kubesgl.engine.transfer import PinnedStaging
from kubesgl.kv.kv_cache import KVCache
from kubesgl.layers.forward import ForwardBatch
from kubesgl.models.decoder import CausalLM

log = logging.getLogger(__name__)


def capture_graph(
    fn: Callable[[], torch.Tensor | None], pool: object
) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
    """`fn` captured into a graph in `pool` (None: a new one), after two warm-up runs on a side stream
    (autotuning and lazy allocations must not happen inside capture); returns the graph and fn's output."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


def capture_sizes(max_bs: int) -> list[int]:
    sizes = [s for s in (1, 2, 4, 8) if s <= max_bs] + list(range(16, max_bs + 1, 16))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def auto_max_bs(device: torch.device, max_running: int) -> int:
    """The largest decode batch captured when --cuda-graph-max-bs is not given (graph_max_bs_for the card).

    Judged on the card's size: by capture time the KV pool has already taken the free memory."""
    _, total = torch.cuda.mem_get_info(device)
    return graph_max_bs_for(total, max_running)


def graph_max_bs_for(total_bytes: int, max_running: int) -> int:
    """256 on a card of 64 GiB or more, else 160; never above max_running_requests.

    Mini-SGLang gives 256 only above 80 GiB (the H200), so an 80 GB H100 (79.2 GiB to CUDA) runs every decode
    step of more than 160 rows eager. Measured on the lent H100 (two calls, 256 streams through one gateway):
    7,355 tok/s at TPOT 29 ms with the 160 limit against 19,356 tok/s at TPOT 8.4 ms with 256, whose 20
    graphs (Qwen3-0.6B) captured in 1.8 s."""
    return min(256 if total_bytes >= 64 * 2**30 else 160, max_running)


class GraphInputs(NamedTuple):
    """A decode batch staged in the graphs' inputs: device views of its rows."""

    slots: torch.Tensor  # [n] the batch's slots
    positions: torch.Tensor  # [n] the position each row's token is fed at
    extra: torch.Tensor  # the values staged after the graph's inputs (the step's page-table writes)


class DecodeGraphs:
    """Per captured batch size: a forward graph (input prep + model + logits) and two sampling graphs.

    Logits stay in the model's dtype: greedy argmax is the same on them, temperature sampling reads them once
    (`gumbel_tokens`), and only the eager sampler casts its rows to float32 (the LM head returns the model dtype).

    Built from its parts (the model, attention backend, KV cache, token pool, page table, sampler and staging
    buffers of one runner), it owns its input layout: `stage` fills it, `replay` runs it. The forward graph of
    size bs reads slots from io[:bs] and positions from io[bs:2 * bs] (each size its own layout, so one
    contiguous copy fills it); the rest of `io` carries whatever the caller stages after them. The sampling
    graphs ("greedy", "temperature") read the forward graph's logits, write the tokens to `tokens` and into
    the token pool at position + 1.
    """

    def __init__(
        self,
        *,
        model: CausalLM,
        attn: AttentionBackend,
        kv: KVCache,
        token_pool: torch.Tensor,  # [slots, max_len] int64
        page_table: torch.Tensor,  # [slots, max_pages] int32
        page_size: int,
        sampler: Sampler,
        staging: PinnedStaging,
        seed: int,
        max_bs: int,
        pad_slot: int,
        compiled: CompiledForward | None = None,
    ) -> None:
        if not supports_cuda_graph(attn):
            raise ValueError(f"attention backend {type(attn).__name__} cannot run in CUDA graphs")
        self.model, self.attn, self.kv = model, attn, kv
        self.token_pool, self.page_table, self.page_size = token_pool, page_table, page_size
        self.sampler, self.staging = sampler, staging
        self.sizes = capture_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.pad_slot = pad_slot
        self.compiled = compiled  # the sizes it accepts capture the compiled forward (compiled at warm-up)
        dev = token_pool.device
        # Room for the slots and positions plus a few page-table writes per row (more go in a new tensor).
        self.io = torch.zeros(2 * self.max_bs + 3 * 4 * self.max_bs, dtype=torch.int64, device=dev)
        self.tokens = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.philox_key = philox_key(seed, dev)
        self._torch_temperature = False
        attn.init_cuda_graph(self.max_bs, page_table.shape[1])
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.samplers: dict[tuple[str, int], torch.cuda.CUDAGraph] = {}
        start = time.perf_counter()
        pool = None
        for bs in reversed(self.sizes):  # largest first, so smaller graphs reuse its pool
            self.io[:bs].fill_(pad_slot)  # capture-time runs write only the scratch slot and page 0
            self.io[bs : 2 * bs].zero_()
            self.graphs[bs], self.logits[bs] = self._capture(lambda bs=bs: self._forward(bs), bs, pool)
            pool = self.graphs[bs].pool()
            for mode in ("greedy", "temperature"):
                self.samplers[mode, bs] = self._capture_sampler(mode, bs, pool)
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured %d decode CUDA graphs (bs <= %d) in %.1f s",
            len(self.sizes),
            self.max_bs,
            self.capture_seconds,
        )

    def _forward(self, bs: int) -> torch.Tensor:
        slots, positions = self.io[:bs], self.io[bs : 2 * bs]
        input_ids, out_loc = decode_inputs(self.token_pool, self.page_table, slots, positions, self.page_size)
        fb = ForwardBatch("decode", input_ids, positions, out_loc, self.attn, self.kv)
        compiled = self.compiled
        forward = compiled if compiled is not None and compiled.accepts(bs) else self.model.forward
        return self.model.compute_logits(forward(fb))

    def _sample(self, mode: str, bs: int) -> None:
        slots, positions, logits = self.io[:bs], self.io[bs : 2 * bs], self.logits[bs]
        if mode == "greedy":
            tokens = greedy_tokens(logits)
        elif mode == "temperature":
            scale = sampling_scale(self.sampler.temperature[slots], self.sampler.greedy[slots])
            tokens = gumbel_tokens(logits, scale, self.philox_key)
            self.philox_key.add_(1)
        else:  # "temperature" in plain torch ops, where the Triton kernel could not be built
            temperature = self.sampler.temperature[slots]
            tokens = temperature_tokens(logits.float(), temperature, self.sampler.greedy[slots])
        self.tokens[:bs].copy_(tokens)
        self.token_pool[slots, positions + 1] = tokens

    def _capture_sampler(self, mode: str, bs: int, pool: object) -> torch.cuda.CUDAGraph:
        if mode == "temperature" and self._torch_temperature:
            mode = "torch-temperature"
        try:
            graph, _ = self._capture(lambda: self._sample(mode, bs), None, pool)
        except Exception:  # a Triton build failure shows in the warm-up, before any capture starts
            if mode != "temperature":
                raise
            log.exception("Gumbel sampling kernel unavailable; sampling in the graph with torch ops")
            self._torch_temperature = True
            return self._capture_sampler(mode, bs, pool)
        return graph

    def _capture(
        self, fn: Callable[[], torch.Tensor | None], bs: int | None, pool: object
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor | None]:
        if bs is not None:
            self.attn.plan_capture(bs)
        return capture_graph(fn, pool)

    def padded_size(self, n: int) -> int | None:
        return next((s for s in self.sizes if s >= n), None)

    def stage(self, bs: int, slots: list[int], positions: list[int], extra: list[int]) -> GraphInputs:
        """Copies a decode batch of len(slots) rows into the inputs of size `bs` (its `padded_size`; padded rows
        name the scratch slot at position 0), followed by `extra`, in one host-to-device copy."""
        n = len(slots)
        pad = bs - n
        packed = slots + [self.pad_slot] * pad + positions + [0] * pad + extra
        if len(packed) <= self.io.numel():
            io = self.staging.upload(packed, self.io)
        else:  # an unusually large `extra`: stage it all in a new tensor, then fill the graph's inputs
            io = self.staging.upload(packed)
            self.io[: 2 * bs].copy_(io[: 2 * bs])
        return GraphInputs(io[:n], io[bs : bs + n], io[2 * bs :])

    def replay(self, meta: AttentionMetadata, bs: int, sample_mode: str | None) -> torch.Tensor:
        """Runs the batch `stage` put in the inputs of size `bs`: [bs] sampled tokens with a `sample_mode`
        (already in the token pool), else the [bs, V] logits."""
        self.attn.plan_replay(meta, bs)
        self.graphs[bs].replay()
        if sample_mode is None:
            return self.logits[bs]
        self.samplers[sample_mode, bs].replay()
        return self.tokens[:bs]
