"""Qwen3-MoE: the Qwen3 decoder with sparse expert MLPs (dense MLPs on `mlp_only_layers`)."""

from __future__ import annotations

import re
from typing import Any

from torch import nn

from kubesgl.distributed import TPGroup
from kubesgl.layers.moe import SparseMoeBlock
from kubesgl.models.decoder import Qwen3ForCausalLM, dense_mlp
from kubesgl.models.hf_config import num_experts_of

_EXPERT_WEIGHT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    def make_mlp(self, config: Any, layer_id: int, tp: TPGroup) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1)
        sparse = layer_id not in getattr(config, "mlp_only_layers", []) and (layer_id + 1) % step == 0
        if not sparse:
            return dense_mlp(config, layer_id, tp)
        return SparseMoeBlock(
            config.hidden_size,
            config.moe_intermediate_size,
            num_experts_of(config),
            config.num_experts_per_tok,
            bool(config.norm_topk_prob),
            tp=tp,
        )

    def map_weight_name(self, name: str) -> tuple[str, Any]:
        """Per-expert checkpoint tensors land in the stacked w13 / w2 of their layer."""
        m = _EXPERT_WEIGHT.match(name)
        if m:
            prefix, expert, part = m.group(1), int(m.group(2)), m.group(3)
            stacked = "w2" if part == "down" else "w13"
            return f"{prefix}.{stacked}", (expert, part)
        return super().map_weight_name(name)
