"""The parts of a forward pass that torch.compile must not trace: custom ops it sees as single opaque calls.

Under `--enable-torch-compile` (engine/compile.py) the model's projections, norms, activations and residuals
are traced and compiled by Inductor, while each layer's attention block (q/k norm, RoPE, the KV-cache store,
paged attention: our Triton kernels and FlashInfer, with host-side plans) and the MoE experts (Triton grouped
GEMMs, or a reference that reads per-expert counts on the host) stay calls of their own, run eagerly between
the compiled pieces, as vLLM's piecewise compilation does around attention.

An attention block needs the batch's `ForwardBatch` (backend, KV cache, out_loc), which is no tensor: the
compiled caller installs it with `forward_context` for the duration of the call, and the op reads it there.
Eager runs never go through these ops (`tracing()` is False outside Dynamo), so they stay bit for bit as
before.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from kubesgl.kernels import fused_moe
from kubesgl.kernels.dispatch import use_triton

if TYPE_CHECKING:
    from kubesgl.layers.forward import ForwardBatch


class AttentionBlock(Protocol):
    def attend(self, qkv: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor: ...


@dataclass
class _Context:
    fb: ForwardBatch
    blocks: Sequence[AttentionBlock]  # by layer id


_current: list[_Context] = []


@contextmanager
def forward_context(fb: ForwardBatch, blocks: Sequence[AttentionBlock]) -> Iterator[None]:
    """The batch and the model's attention blocks (indexed by layer id) that the attention op runs on."""
    _current.append(_Context(fb, blocks))
    try:
        yield
    finally:
        _current.pop()


def tracing() -> bool:
    """True while Dynamo traces a forward pass: the layers then call the ops below instead of the eager code."""
    return torch.compiler.is_compiling()


@torch.library.custom_op("kubesgl::attention_block", mutates_args=())
def attention_block(qkv: torch.Tensor, positions: torch.Tensor, layer_id: int, q_size: int) -> torch.Tensor:
    """Layer `layer_id`'s block from the fused qkv projection to the attention output [T, q_size]: q/k norm,
    RoPE, the K/V store into the cache and paged attention, on the batch `forward_context` installed.

    The output must be a tensor of its own (every backend allocates it per call): Inductor may reuse its
    memory for later buffers once the o projection has read it."""
    if not _current:
        raise RuntimeError("kubesgl::attention_block called outside forward_context")
    ctx = _current[-1]
    # The fused Triton prep only reads qkv; the torch prep rotates q and k in place inside it, so it gets a copy
    # (declaring qkv mutated instead would have Inductor copy it on the GPU path too).
    return ctx.blocks[layer_id].attend(qkv if use_triton(qkv) else qkv.clone(), positions, ctx.fb)


@attention_block.register_fake
def _(qkv: torch.Tensor, positions: torch.Tensor, layer_id: int, q_size: int) -> torch.Tensor:
    return qkv.new_empty(qkv.shape[0], q_size)


@torch.library.custom_op("kubesgl::fused_moe", mutates_args=())
def moe_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    """`kernels.fused_moe` as one opaque call."""
    return fused_moe(x, w13, w2, topk_weights, topk_ids)


@moe_experts.register_fake
def _(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor
) -> torch.Tensor:
    return torch.empty_like(x)
