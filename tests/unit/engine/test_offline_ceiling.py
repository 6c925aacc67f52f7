"""`kubesgl bench offline`'s ceilings: the decode-bytes term and the prefill-FLOPs term, from the model's shapes."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubesgl.bench.offline import layer_macs_per_token, memory_bound_seconds, prefill_flop_seconds
from kubesgl.models.loader import load_model
from kubesgl.models.random_init import build_random_model


def test_prefill_flops_count_projections_and_causal_attention() -> None:
    # Two prompts of 3 and 1 tokens, 10 MACs per token in the layers, 2 layers of attention width 4:
    # projections 2*10*(3+1) = 80 FLOPs; attention 2 (QK, PV) * 2 * layers * width * (1+2+3 + 1) = 224.
    assert prefill_flop_seconds([[1, 2, 3], [4]], 10, 2, 4, rate=1.0) == 80 + 224
    assert prefill_flop_seconds([[1, 2, 3], [4]], 10, 2, 4, rate=304.0) == 1.0


def test_layer_macs_count_weights_once_and_only_the_active_experts(tmp_path: Path) -> None:
    dense = load_model(build_random_model("qwen3", tmp_path / "dense"))
    c = dense.hf_config
    d, h = c.head_dim, c.hidden_size
    qkv = h * (c.num_attention_heads + 2 * c.num_key_value_heads) * d
    per_layer = qkv + c.num_attention_heads * d * h + 3 * h * c.intermediate_size
    assert layer_macs_per_token(dense) == c.num_hidden_layers * per_layer

    moe = load_model(build_random_model("qwen3_moe", tmp_path / "moe"))
    all_experts = sum(p.numel() for n, p in moe.model.layers.named_parameters() if ".experts." in n)
    everything = sum(p.numel() for p in moe.model.layers.parameters() if p.dim() >= 2)
    c = moe.hf_config
    active = all_experts * c.num_experts_per_tok // (getattr(c, "num_experts", None) or c.num_local_experts)
    assert layer_macs_per_token(moe) == everything - all_experts + active < everything


def test_memory_bound_reads_the_weights_and_live_kv_each_step() -> None:
    # One request of a 2-token prompt and 3 outputs: steps read 2, 3, 4 tokens of KV plus the weights.
    assert memory_bound_seconds([[0, 0]], [3], weight_bytes=100, kv_bytes_per_token=10, bw=1.0, max_bs=8) == (
        pytest.approx(3 * 100 + (2 + 3 + 4) * 10)
    )
