"""The Triton fast paths (RMSNorm, rotary, SiLU-and-mul, fused MoE) against torch and HF references.

Without CUDA the Triton kernels run in Triton's interpreter on float32 CPU tensors (tests/conftest.py
turns it on); on a CUDA machine the `gpu` tests run them compiled in bf16.
"""

from __future__ import annotations

import pytest
import torch
from kubesgl.kernels import activation_triton, fused_moe_triton, norm_triton, qkv_prep_triton, rotary_triton
from kubesgl.kernels.activation import silu_and_mul, silu_and_mul_torch
from kubesgl.kernels.fused_moe import experts_forward, fused_moe
from kubesgl.kernels.norm import fused_add_rms_norm, rms_norm, rms_norm_torch
from kubesgl.kernels.qkv_prep import qkv_prep_torch
from kubesgl.kernels.rotary import apply_rotary_neox, apply_rotary_neox_torch
from kubesgl.layers.moe import route_topk
from kubesgl.layers.rotary import RotaryEmbedding
from support.numerics import elementwise_bound, rel_err, reorder_bound, unit_roundoff
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

CUDA = torch.cuda.is_available()
# float32 kernels against float32 torch: the same formulas, other summation and operation orders.
ROTARY_TOL = (
    elementwise_bound(torch.float32, 3) * 2**0.5
)  # x*cos - y*sin: 3 roundings, a norm-preserving turn
SILU_MUL_TOL = elementwise_bound(torch.float32, 5)  # exp, add, divide, multiply, multiply
# bf16 kernels against float32 references: the inputs, an intermediate and the output each rounded to bf16.
BF16_TOL = 3 * unit_roundoff(torch.bfloat16)
BF16_MOE_TOL = 5 * unit_roundoff(torch.bfloat16)  # + the two GEMMs' outputs and the weighted expert sum
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover these kernels compiled")


def randn(*shape: int, seed: int, dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype).to(device)


# --- the public functions on CPU (torch paths) agree with HF transformers' own code -------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_hf_qwen3(dtype: torch.dtype) -> None:
    hf = Qwen3RMSNorm(48, eps=1e-6).to(dtype)
    hf.weight.data.copy_(randn(48, seed=0))
    x, res = randn(5, 48, seed=1, dtype=dtype), randn(5, 48, seed=2, dtype=dtype)
    # The same torch ops in the same order as HF's: bit for bit.
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
    assert rel_err(q, ref_q) < ROTARY_TOL and rel_err(k, ref_k) < ROTARY_TOL


# --- CPU: the Triton kernels in the interpreter ------------------------------------------------------


@cpu_interpreter
@pytest.mark.parametrize("hidden", [48, 1024])
def test_triton_rms_norm_matches_torch(hidden: int) -> None:
    x, res, w = randn(5, hidden, seed=5), randn(5, hidden, seed=6), randn(hidden, seed=7)
    tol = reorder_bound(torch.float32, hidden)  # the sum of squares, in the kernel's block order
    assert rel_err(norm_triton.rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)) < tol
    out, summed = norm_triton.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    assert rel_err(out, rms_norm_torch(x + res, w, 1e-6)) < tol


@cpu_interpreter
def test_triton_rotary_matches_layer() -> None:
    rope = RotaryEmbedding(head_dim=32, max_position=128, base=1e6)
    qkv = randn(9, (8 + 2 + 2) * 32, seed=8)
    q, k, _ = qkv.split([256, 64, 64], dim=-1)
    positions = torch.randint(0, 128, (9,), generator=torch.Generator().manual_seed(9))
    ref_q, ref_k = hf_rotary(positions, q, k, rope)
    rotary_triton.apply_rotary_neox(positions, q, k, rope.cos, rope.sin)
    assert rel_err(q, ref_q) < ROTARY_TOL and rel_err(k, ref_k) < ROTARY_TOL


@cpu_interpreter
def test_triton_silu_and_mul_matches_torch() -> None:
    x = randn(3, 2 * 1500, seed=10)  # 1500 > one 1024-wide block
    assert rel_err(activation_triton.silu_and_mul(x), silu_and_mul_torch(x)) < SILU_MUL_TOL


MOE_SHAPE = (8, 64, 48, 2)  # experts, hidden, intermediate, top_k
# The gate/up sum over hidden, the down sum over intermediate, the top_k expert sum, in the kernel's order.
MOE_TOL = reorder_bound(torch.float32, MOE_SHAPE[1] + MOE_SHAPE[2] + MOE_SHAPE[3])


def moe_inputs(tokens: int, seed: int, dtype: torch.dtype, device: str) -> tuple[torch.Tensor, ...]:
    experts, hidden, inter, top_k = MOE_SHAPE
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
    assert rel_err(fused_moe_triton.fused_moe(*args), experts_forward(*args)) < MOE_TOL


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


def qkv_prep_case(
    heads: int, kv_heads: int, head_dim: int, tokens: int, norm: bool, dtype: torch.dtype, device: str
) -> dict:
    """Inputs for qkv_prep: a fused qkv row per token, positions, distinct cache slots in a 40-slot cache."""
    rope = RotaryEmbedding(head_dim=head_dim, max_position=512, base=1e6).to(device)
    gen = torch.Generator().manual_seed(heads * 100 + tokens)
    slots = 40
    return {
        "qkv": randn(tokens, (heads + 2 * kv_heads) * head_dim, seed=20, dtype=dtype, device=device),
        "positions": torch.randint(0, 512, (tokens,), generator=gen).to(device),
        "out_loc": torch.randperm(slots, generator=gen)[:tokens].to(device),
        "cos": rope.cos,
        "sin": rope.sin,
        "q_norm_weight": randn(head_dim, seed=21, dtype=dtype, device=device) if norm else None,
        "k_norm_weight": randn(head_dim, seed=22, dtype=dtype, device=device) if norm else None,
        "eps": 1e-6,
        "k_cache": torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device),
        "v_cache": torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device),
        "num_q_heads": heads,
        "num_kv_heads": kv_heads,
    }


def check_qkv_prep(fn, case: dict, tol: float) -> None:  # noqa: ANN001
    ref = {**case, "k_cache": case["k_cache"].clone(), "v_cache": case["v_cache"].clone()}
    q_ref = qkv_prep_torch(**ref)
    q = fn(**case)
    assert q.shape == q_ref.shape and q.is_contiguous()
    assert rel_err(q, q_ref) < tol
    assert rel_err(case["k_cache"], ref["k_cache"]) < tol
    assert torch.equal(case["v_cache"], ref["v_cache"])  # v is copied, bit for bit
    untouched = torch.ones(case["k_cache"].shape[0], dtype=torch.bool)
    untouched[case["out_loc"].cpu()] = False
    assert not case["k_cache"][untouched.to(q.device)].any()  # nothing written outside out_loc


@cpu_interpreter
@pytest.mark.parametrize(
    ("heads", "kv_heads", "head_dim", "norm"),
    [(4, 2, 32, True), (6, 3, 32, True), (4, 4, 16, False), (2, 1, 24, True)],
    ids=["qwen3_like", "heads_not_pow2", "no_qk_norm", "head_dim_not_pow2"],
)
def test_triton_qkv_prep_matches_unfused_ops(heads: int, kv_heads: int, head_dim: int, norm: bool) -> None:
    case = qkv_prep_case(heads, kv_heads, head_dim, tokens=7, norm=norm, dtype=torch.float32, device="cpu")
    # Per-head RMSNorm (a head_dim sum) then the rotary turn.
    check_qkv_prep(qkv_prep_triton.qkv_prep, case, reorder_bound(torch.float32, head_dim) + ROTARY_TOL)


def test_qkv_prep_torch_equals_the_layer_ops_it_replaces() -> None:
    """The reference is the unfused layer path: per-head RMSNorm, RoPE, then the KV cache store."""
    case = qkv_prep_case(4, 2, 32, tokens=5, norm=True, dtype=torch.float32, device="cpu")
    q_ref = qkv_prep_torch(**case)
    q, k, v = case["qkv"].split([128, 64, 64], dim=-1)
    q, k = (
        rms_norm_torch(q.reshape(5, 4, 32), case["q_norm_weight"], 1e-6),
        rms_norm_torch(k.reshape(5, 2, 32), case["k_norm_weight"], 1e-6),
    )
    rope = RotaryEmbedding(head_dim=32, max_position=512, base=1e6)
    q2, k2 = rope(case["positions"], q.reshape(5, -1).clone(), k.reshape(5, -1).clone())
    tol = reorder_bound(torch.float32, 32) + ROTARY_TOL  # the head_dim-32 norm, then the turn
    assert rel_err(q_ref.reshape(5, -1), q2) < tol
    assert rel_err(case["k_cache"][case["out_loc"]].reshape(5, -1), k2) < tol
    assert torch.equal(case["v_cache"][case["out_loc"]].reshape(5, -1), v)


def test_qkv_prep_rejects_a_qkv_row_of_the_wrong_width() -> None:
    case = qkv_prep_case(4, 2, 32, tokens=3, norm=True, dtype=torch.float32, device="cpu")
    case["num_q_heads"] = 5
    with pytest.raises(ValueError, match="qkv width"):
        qkv_prep_triton.qkv_prep(**case)


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
    assert rel_err(rms_norm(x, w, 1e-6), rms_norm_torch(x, w, 1e-6)) < BF16_TOL
    out, summed = fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(summed, x + res)
    assert rel_err(out, rms_norm_torch(x + res, w, 1e-6)) < BF16_TOL

    rope = RotaryEmbedding(head_dim=128, max_position=4096, base=1e6).cuda()
    qkv = randn(300, (16 + 8 + 8) * 128, seed=16, dtype=bf16, device="cuda")
    q, k, _ = qkv.split([2048, 1024, 1024], dim=-1)
    positions = torch.randint(0, 4096, (300,), device="cuda")
    ref_q, ref_k = apply_rotary_neox_torch(positions, q.float(), k.float(), rope.cos, rope.sin)
    apply_rotary_neox(positions, q, k, rope.cos, rope.sin)
    assert rel_err(q, ref_q) < BF16_TOL and rel_err(k, ref_k) < BF16_TOL

    gate_up = randn(300, 2 * 3072, seed=17, dtype=bf16, device="cuda")
    assert rel_err(silu_and_mul(gate_up), silu_and_mul_torch(gate_up)) < BF16_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 64, 2000])
def test_gpu_fused_moe_matches_experts_forward(tokens: int) -> None:
    args = moe_inputs(tokens, seed=18, dtype=torch.bfloat16, device="cuda")
    assert rel_err(fused_moe(*args), experts_forward(*args)) < BF16_MOE_TOL


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("tokens", [1, 256, 3000])
def test_gpu_qkv_prep_matches_unfused_ops(tokens: int) -> None:
    slots_needed = max(tokens, 40)
    case = qkv_prep_case(16, 8, 128, tokens=min(tokens, 40), norm=True, dtype=torch.bfloat16, device="cuda")
    if tokens > 40:  # a prefill-sized batch: a cache with room for every token
        gen = torch.Generator().manual_seed(tokens)
        case["qkv"] = randn(tokens, 32 * 128, seed=23, dtype=torch.bfloat16, device="cuda")
        case["positions"] = torch.randint(0, 512, (tokens,), generator=gen).cuda()
        case["out_loc"] = torch.randperm(slots_needed, generator=gen).cuda()
        case["k_cache"] = torch.zeros(slots_needed, 8, 128, dtype=torch.bfloat16, device="cuda")
        case["v_cache"] = torch.zeros_like(case["k_cache"])
    check_qkv_prep(qkv_prep_triton.qkv_prep, case, BF16_TOL)
