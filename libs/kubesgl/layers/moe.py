"""Sparse mixture-of-experts block (Qwen3-MoE): softmax top-k router and experts sharded over TP.

Experts are stacked: w13 [E, 2*I/tp, H] holds each expert's [gate | up] rows for this rank's slice of
the intermediate dim, w2 [E, H, I/tp] its down projection. The block runs `kernels.fused_moe`: Triton
grouped GEMMs on CUDA (no host sync, so decode can be captured in a CUDA graph) and its plain-torch
reference `kernels.fused_moe.experts_forward` elsewhere.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kubesgl.distributed import TPGroup, shard_range
from kubesgl.kernels import fused_moe
from kubesgl.kernels.fused_moe import ExpertsForward
from kubesgl.layers import opaque
from kubesgl.layers.linear import copy_checked, load_full, make_param


def route_topk(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts in float32, keep the top-k; returns (weights [T, k], expert ids [T, k])."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


class SparseMoeBlock(nn.Module):
    """Router (replicated) + TP-sharded experts; the partial expert outputs are all-reduced."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        renormalize: bool,
        *,
        tp: TPGroup,
        experts_impl: ExpertsForward = fused_moe,
    ) -> None:
        super().__init__()
        self.tp = tp
        self.top_k = top_k
        self.renormalize = renormalize
        self.experts_impl = experts_impl
        start, end = shard_range(intermediate_size, tp)
        self.inter_start, self.inter_per_rank = start, end - start
        self.gate = nn.Module()
        self.gate.weight = make_param((num_experts, hidden_size), load_full)
        self.experts = nn.Module()
        # shard_id is (expert, "gate" | "up" | "down"): 2 tensors per expert fill w13, 1 fills w2.
        i = self.inter_per_rank
        self.experts.w13 = make_param((num_experts, 2 * i, hidden_size), self._load, 2 * num_experts)
        self.experts.w2 = make_param((num_experts, hidden_size, i), self._load, num_experts)

    def _load(self, param: nn.Parameter, full: torch.Tensor, shard_id: tuple[int, str]) -> None:
        expert, part = shard_id
        i, s = self.inter_per_rank, self.inter_start
        if part == "down":
            copy_checked(param.data[expert], full[:, s : s + i], f"expert {expert} down_proj")
        else:
            offset = 0 if part == "gate" else i
            copy_checked(
                param.data[expert, offset : offset + i], full[s : s + i], f"expert {expert} {part}_proj"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route_topk(F.linear(x, self.gate.weight), self.top_k, self.renormalize)
        # torch.compile: the experts are one opaque op (their reference reads per-expert counts on the host).
        experts = (
            opaque.moe_experts if opaque.tracing() and self.experts_impl is fused_moe else self.experts_impl
        )
        out = experts(x, self.experts.w13, self.experts.w2, weights, ids)
        return self.tp.all_reduce(out)
