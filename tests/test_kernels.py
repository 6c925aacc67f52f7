"""The Triton fast paths (RMSNorm, rotary, SiLU-and-mul, fused MoE) against torch and HF references.

Without CUDA the Triton kernels run in Triton's interpreter on float32 CPU tensors (tests/conftest.py
turns it on); on a CUDA machine the `gpu` tests run them compiled in bf16.
"""

from __future__ import annotations

import pytest
import torch
from kubesgl.kernels import activation_triton, fused_moe_triton, norm_triton, rotary_triton
from kubesgl.kernels.activation import silu_and_mul, silu_and_mul_torch
from kubesgl.kernels.fused_moe import fused_moe
from kubesgl.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_torch
from kubesgl.kernels.rotary import apply_rotary_neox, apply_rotary_neox_torch
from kubesgl.layers.moe import experts_forward, route_topk
from kubesgl.layers.rotary import RotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover these kernels compiled")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert out.shape == ref.shape and torch.isfinite(out).all()
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# --- the public functions on CPU (torch paths) agree with HF transformers' own code -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_qwen3(dtype: torch.dtype) -> None:
    hf = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
    hf.weight.data.copy_(randn(48, seed=0))
    x, res = randn(5, 48, seed=1, dtype=dtype), randn(5, 48, seed=2, dtype=dtype)
    torch.testing.assert_close(rms_norm(x, hf.weight, 1e-6), hf(x), rtol=0, atol=0)
    out, summed = fused_add_rms_norm(x, res, hf.weight, 1e-6)
    torch.testing.assert_close(summed, x + res, rtol=0, atol=0)
    torch.testing.assert_close(out, hf(x + res), rtol=0, atol=0)


def hf_rotary(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, rope: RotaryEmbedding) -> tuple:
    """HF's apply_rotary_pos_emb on [1, heads, T, D] views, with full-width cos/sin as HF builds them."""
    d = rope.head_dim
    cos = torch.cat([rope.cos[positions]] * 2, dim=-1)[None]
    sin = torch.cat([rope.sin[positions]] * 2, dim=-1)[None]

    def heads(x: torch.Tensor) -> torch.Tensor:
        return x.reshape(x.shape[0], -1, d).transpose(0, 1)[None]

    q_out, k_out = apply_rotary_pos_emb(heads(q), heads(k), cos, sin)
    return q_out[0].transpose(0, 1).reshape(q.shape), k_out[0].transpose(0, 1).reshape(k.shape)


def test_rotary_matches_hf_in_place_on_strided_views() -> None:
    rope = RotaryEmbedding(head_dim=16, max_position=64, base=10000.0)
    qkv = randn(6, (4 + 2 + 2) * 16, seed=3)
    q, k, _ = qkv.split([64, 32, 32], dim=-1)  # row-strided views, as the attention layer gets them
    positions = torch.tensor([0, 3, 5, 63, 2, 7])
    ref_q, ref_k = hf_rotary(positions, q, k, rope)
    out_q, out_k = apply_rotary_neox(positions, q, k, rope.cos, rope.sin)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    torch.testing.assert_close(q, ref_q)
    torch.testing.assert_close(k, ref_k)


# --- CPU: the Triton kernels in the interpreter ------------------------------------------------------


@cpu_interpreter
@pytest.mark.parametrize("hidden", [48, 1024])
def test_triton_rms_norm_matches_torch(hidden: int) -> None:
    x, res, w = randn(5, hidden, seed=5), randn(5, hidden, seed=6), randn(hidden, seed=7)
    assert rel_err(norm_triton.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)) < 1e-6
    out, summed = norm_triton.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    assert rel_err(out, rms_norm_torch(x + res, w, 1e-6)) < 1e-6


@cpu_interpreter
def test_triton_rotary_matches_layer() -> None:
    rope = RotaryEmbedding(head_dim=32, max_position=128, base=1e6)
    qkv = randn(9, (8 + 2 + 2) * 32, seed=8)
    q, k, _ = qkv.split([256, 64, 64], dim=-1)
    positions = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(9))
    ref_q, ref_k = hf_rotary(positions, q, k, rope)
    rotary_triton.apply_rotary_neox(positions, q, k, rope.cos, rope.sin)
    assert rel_err(q, ref_q) < 1e-6 and rel_err(k, ref_k) < 1e-6


@cpu_interpreter
def test_triton_silu_and_mul_matches_torch() -> None:
    x = randn(3, 2 * 1500, seed=10)  # 1500 > one 1024-wide block
    assert rel_err(activation_triton.silu_and_mul(x), silu_and_mul_torch(x)) < 1e-6


def moe_inputs(tokens: int, seed: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    experts, hidden, inter, top_k = 8, 64, 48, 2
    x = randn(tokens, hidden, seed=seed, dtype=dtype, device=device)
    w13 = randn(experts, 2 * inter, hidden, seed=seed + 1, dtype=dtype, device=device) * 0.1
    w2 = randn(experts, hidden, inter, seed=seed + 2, dtype=dtype, device=device) * 0.1
    logits = randn(tokens, experts, seed=seed + 3, device=device)
    weights, ids = route_topk(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@cpu_interpreter
@pytest.mark.parametrize("tokens", [1, 13, 300], ids=["decode", "small", "prefill_64_row_tiles"])
def test_triton_fused_moe_matches_experts_forward(tokens: int) -> None:
    args = moe_inputs(tokens, seed=11, dtype=torch.float32, device="cpu")
    assert rel_err(fused_moe_triton.fused_moe(*args), experts_forward(*args)) < 1e-5


def test_align_to_experts_tiles_hold_one_expert_and_every_assignment_once() -> None:
    ids = torch.randint(0, 6, (37, 2), generator=torch.Generator().manual_seed(12))
    sorted_ids, tile_expert = fused_moe_triton.align_to_experts(ids, num_experts=6, block_m=16)
    flat = ids.reshape(-1)
    real = sorted_ids[sorted_ids < flat.numel()]
    assert sorted(real.tolist()) == list(range(flat.numel()))
    for tile, expert in enumerate(tile_expert.tolist()):
        members = sorted_ids[tile * 16 : (tile + 1) * 16]
        members = members[members < flat.numel()].long()
        if expert == 6:  # past the last expert's run: nothing left
            assert members.numel() == 0
        else:
            assert (flat[members] == expert).all()


# --- GPU: compiled, bf16 -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_norm_rotary_activation_match_torch() -> None:
    bf16 = torch.bfloat16
    x, res = (
        randn(300, 1024, seed=13, dtype=bf16, device="cuda"),
        randn(300, 1024, seed=14, dtype=bf16, device="cuda"),
    )
    w = randn(1024, seed=15, dtype=bf16, device="cuda")
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)) < 1e-2
    out, summed = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    assert rel_err(out, rms_norm_torch(x + res, w, 1e-6)) < 1e-2

    rope = RotaryEmbedding(head_dim=128, max_position=4096, base=1e6).cuda()
    qkv = randn(300, (16 + 8 + 8) * 128, seed=16, dtype=bf16, device="cuda")
    q, k, _ = qkv.split([2048, 1024, 1024], dim=-1)
    positions = torch.randint(0, 4096, (300,), device="cuda")
    ref_q, ref_k = apply_rotary_neox_torch(positions, q.float(), k.float(), rope.cos, rope.sin)
    apply_rotary_neox(positions, q, k, rope.cos, rope.sin)
    assert rel_err(q, ref_q) < 1e-2 and rel_err(k, ref_k) < 1e-2

    gate_up = randn(300, 2 * 3072, seed=17, dtype=bf16, device="cuda")
    assert rel_err(silu_and_mul(gate_up), silu_and_mul_torch(gate_up)) < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 2000])
def test_gpu_fused_moe_matches_experts_forward(tokens: int) -> None:
    args = moe_inputs(tokens, seed=18, dtype=torch.bfloat16, device="cuda")
    assert rel_err(fused_moe(*args), experts_forward(*args)) < 2e-2
