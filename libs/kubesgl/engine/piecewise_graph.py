"""Piecewise CUDA graphs for extend (prefill) steps: the forward cut at its attention kernels.

An eager extend step pays the host for every op of every layer (Python, aten dispatch, a Triton or cuBLAS
launch each) whatever its size: on the lent H100s an 8-token prefill of Qwen3-0.6B took 14-22 ms to launch
(two hosts; benchmark/extend_host.py) where its kernels need ~1.5 ms, so a served burst's first, small prefill
steps (one or two requests that arrived before the rest) each held the GPU that long. As vLLM's piecewise CUDA graphs and SGLang's
`--enable-piecewise-cuda-graph` do, the pieces between attention kernels are captured once per token bucket,
and an extend step of T tokens replays the smallest bucket >= T: L + 1 graph replays (L layers), with the L
attention calls eager between them (their shapes follow the batch's requests, which no graph can fix).

Pieces (`DecoderModel.piece`): piece 0 embeds and runs layer 0 to its attention kernel; piece i finishes layer
i - 1 from its attention output and runs layer i to its kernel; piece L finishes the last layer and the final
norm. Between replays only three buffers cross: q (written by the piece's fused qkv-prep into `q` here),
the attention output (copied into `attn_out`), and the final hidden states (`hidden`). The residual stream
stays inside the pieces: piece i's residual is a tensor of the graphs' pool that piece i + 1 reads; once piece
i + 1 is captured nothing holds it, so later pieces reuse its memory (replays run in capture order, one
bucket at a time, so a block is dead before it is written again). Every bucket shares one pool (largest
first), which therefore holds one piece's working set, not L + 1 of them.

Padded tokens (T..bucket) write their K/V to slot 0, in the scratch page 0 that no request owns (`out_loc` is
zeroed past T on every replay); their ids and positions are whatever an earlier step left (valid values) and
their rows of every output are dropped.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import torch

from kubesgl.attention.base import AttentionBackend
from kubesgl.engine.cuda_graph import capture_graph
from kubesgl.kernels.dispatch import triton_installed
from kubesgl.kernels.fused_moe import fused_moe
from kubesgl.kv.kv_cache import KVCache
from kubesgl.layers.forward import ForwardBatch
from kubesgl.layers.moe import SparseMoeBlock
from kubesgl.models.decoder import CausalLM, DecoderModel, DenseMLP

log = logging.getLogger(__name__)

# The default largest bucket (the prefill chunk up to this): the pool holds that many tokens' activations for
# good (Qwen3-0.6B's gate_up output alone is 100 MB at 8,192 tokens; a 14B model's at 32k tokens, 2.3 GB).
AUTO_MAX_TOKENS = 8192


def token_buckets(max_tokens: int) -> list[int]:
    """The captured token counts up to `max_tokens`: powers of two to 256, then steps of a quarter of the
    power of two below (padding wastes at most ~25 % of a large step's device time), and `max_tokens`."""
    sizes = [s for s in (16, 32, 64, 128, 256) if s < max_tokens]
    size = 256
    while size < max_tokens:
        size += max(64, 1 << (size.bit_length() - 3))
        sizes.append(min(size, max_tokens))
    if not sizes or sizes[-1] != max_tokens:
        sizes.append(max_tokens)
    return sorted(set(sizes))


def piecewise_applies(model: CausalLM) -> str | None:
    """Why `model` cannot run piecewise graphs, or None when it can: a `DecoderModel` (its pieces) whose MLPs
    are dense, or mixture-of-experts blocks whose experts run the Triton kernel (`fused_moe_triton`: routed on
    the device into buffers sized by the token count alone, as the decode graphs capture it; the reference
    experts read per-expert counts on the host, which no graph can)."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, DecoderModel):
        return f"{type(model).__name__} is not a DecoderModel"
    for layer in inner.layers:
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            if mlp.experts_impl is not fused_moe or not triton_installed():
                return "mixture-of-experts without the Triton experts kernel"
        elif not isinstance(mlp, DenseMLP):
            return f"an MLP of type {type(mlp).__name__}"
    return None


def auto_max_tokens(model: CausalLM, max_prefill_tokens: int) -> int:
    """The largest bucket without --piecewise-cuda-graph-max-tokens: the prefill chunk up to AUTO_MAX_TOKENS for
    dense decoders, whose captured pieces the GPU tests checked against eager extend steps (2026-12-06); 0 (off)
    for the rest. Mixture-of-experts pieces were only run op by op on CPU: a value for the flag turns them on."""
    inner = getattr(model, "model", None)
    dense = isinstance(inner, DecoderModel) and all(isinstance(layer.mlp, DenseMLP) for layer in inner.layers)
    return min(max_prefill_tokens, AUTO_MAX_TOKENS) if dense else 0


class PrefillGraphs:
    """Per token bucket, L + 1 piece graphs over static inputs; `run` replays an extend step through them."""

    def __init__(
        self, *, model: CausalLM, attn: AttentionBackend, kv: KVCache, max_tokens: int, device: torch.device
    ) -> None:
        why = piecewise_applies(model)
        if why is not None:
            raise ValueError(f"piecewise CUDA graphs do not apply: {why}")
        self.decoder: DecoderModel = model.model
        self.layers = list(self.decoder.layers)
        self.attn, self.kv = attn, kv
        self.sizes = token_buckets(max_tokens)
        self.max_tokens = self.sizes[-1]
        first = self.layers[0].self_attn.attn
        n, dtype = self.max_tokens, model.dtype
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.out_loc = torch.zeros(n, dtype=torch.int64, device=device)  # slot 0: the scratch page
        self.q = torch.zeros(n, first.num_heads * first.head_dim, dtype=dtype, device=device)
        self.attn_out = torch.zeros_like(self.q)
        self.hidden = torch.zeros(n, model.hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        start = time.perf_counter()
        pool = None
        captured = self.sizes if device.type == "cuda" else []  # on CPU `run` takes the pieces op by op
        for size in reversed(captured):  # largest first: the smaller ones fit in its pool
            self.graphs[size] = pieces = []
            fb = self._static_batch(size)
            residual: torch.Tensor | None = None
            for i in range(len(self.layers) + 1):
                graph, residual = capture_graph(partial(self._piece, i, size, fb, residual), pool)
                pool = graph.pool()
                pieces.append(graph)
        self.capture_seconds = time.perf_counter() - start
        log.info(
            "captured piecewise prefill CUDA graphs: %d token buckets (<= %d) x %d pieces in %.1f s",
            len(self.sizes),
            self.max_tokens,
            len(self.layers) + 1,
            self.capture_seconds,
        )

    def _piece(
        self, i: int, size: int, fb: ForwardBatch, residual: torch.Tensor | None
    ) -> torch.Tensor | None:
        """Piece i at `size` tokens over the static buffers; returns the residual the next piece reads."""
        attn_out = self.attn_out[:size] if i else None
        out, residual = self.decoder.piece(i, fb, attn_out, residual, self.q[:size])
        if residual is None:  # the last piece: the final hidden states
            self.hidden[:size].copy_(out)
        return residual

    def _static_batch(self, size: int) -> ForwardBatch:
        """The pieces' view of a `size`-token step: the static inputs (attention runs on the step's own batch)."""
        ids, positions, out_loc = self.input_ids[:size], self.positions[:size], self.out_loc[:size]
        return ForwardBatch("extend", ids, positions, out_loc, self.attn, self.kv)

    def bucket(self, tokens: int) -> int | None:
        """The smallest captured size >= `tokens`, or None when the step is larger than every bucket."""
        return next((s for s in self.sizes if s >= tokens), None)

    def run(self, fb: ForwardBatch, size: int) -> torch.Tensor:
        """The final hidden states [T, hidden] of the extend step `fb` (its attention already planned), through
        the graphs of `size` (its `bucket`). The result is a view of a buffer the next step overwrites."""
        t = fb.num_tokens
        self.input_ids[:t].copy_(fb.input_ids)
        self.positions[:t].copy_(fb.positions)
        self.out_loc[:t].copy_(fb.out_loc)
        self.out_loc[t:size].zero_()  # padded tokens write the scratch page, never a request's slot
        q, attn_out = self.q[:t], self.attn_out[:t]
        pieces = self.graphs.get(size)
        if pieces is None:  # no graphs (CPU): the same pieces over the same buffers, op by op
            return self._run_eager(fb, size)
        for layer, graph in zip(self.layers, pieces, strict=False):
            graph.replay()
            attn_out.copy_(layer.self_attn.attn(q, fb))
        pieces[-1].replay()
        return self.hidden[:t]

    def _run_eager(self, fb: ForwardBatch, size: int) -> torch.Tensor:
        """What the graphs of `size` replay, run op by op (the CPU tests' view of the piecewise path)."""
        t = fb.num_tokens
        static = self._static_batch(size)
        residual = None
        for i, layer in enumerate(self.layers):
            residual = self._piece(i, size, static, residual)
            self.attn_out[:t].copy_(layer.self_attn.attn(self.q[:t], fb))
        self._piece(len(self.layers), size, static, residual)
        return self.hidden[:t]
