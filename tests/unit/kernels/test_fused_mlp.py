"""The one-kernel decode MLP (kernels/fused_mlp.py) against the unfused gate_up -> SiLU·mul -> down, and the
residual norm that reads its float32 sum.

Without CUDA the kernel runs in Triton's interpreter on float32 CPU tensors; the `gpu` tests run it compiled
in bf16 at Qwen3-0.6B's shapes, and the decoder's MLP with the switch on.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from kubesgl.distributed import TPGroup
from kubesgl.kernels import fused_mlp_triton, norm_triton
from kubesgl.kernels.fused_mlp import FUSED_MLP_MAX_ROWS, fused_mlp_applies, fused_mlp_torch
from kubesgl.kernels.norm import fused_add_rms_norm
from kubesgl.models.decoder import DenseMLP
from support.numerics import elementwise_bound, randn, rel_err, reorder_bound, unit_roundoff

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernel compiled")


def mlp_inputs(m: int, hidden: int, inter: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        randn(m, hidden, seed=seed),
        randn(2 * inter, hidden, seed=seed + 1, scale=hidden**-0.5),
        randn(hidden, inter, seed=seed + 2, scale=inter**-0.5),
    )


def mlp_tol(dtype: torch.dtype, hidden: int, inter: int) -> float:
    """gate and up (length-hidden sums), SiLU·mul (5 roundings), down (a length-inter sum)."""
    return 2 * reorder_bound(dtype, hidden) + elementwise_bound(dtype, 5) + reorder_bound(dtype, inter)


@cpu_interpreter
@pytest.mark.parametrize("m", [1, 5, 16])
def test_triton_fused_mlp_matches_unfused(m: int) -> None:
    # An intermediate width that is not a multiple of the kernel's slice, a hidden width not one of its tiles.
    hidden, inter = 160, 40
    x, w13, w2 = mlp_inputs(m, hidden, inter, seed=m)
    out = fused_mlp_triton.fused_mlp(x, w13, w2)
    assert out.dtype == torch.float32
    assert rel_err(out, fused_mlp_torch(x, w13, w2)) < mlp_tol(torch.float32, hidden, inter)


def test_fused_mlp_rejects_weights_of_the_wrong_shape() -> None:
    x, w13, w2 = mlp_inputs(2, 32, 16, seed=0)
    with pytest.raises(ValueError, match="fused_mlp"):
        fused_mlp_triton.fused_mlp(x, w13, w2.t().contiguous())


def test_fused_mlp_stays_off_on_cpu_even_when_switched_on(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KUBESGL_FUSED_MLP", "1")
    assert not fused_mlp_applies(torch.zeros(1, 8))


@pytest.mark.parametrize(
    ("impl", "dtype"),
    [(fused_add_rms_norm, torch.bfloat16), (norm_triton.fused_add_rms_norm, torch.float16)],
    ids=["torch", "triton"],  # the interpreter has numpy's float16, not bf16
)
def test_residual_norm_rounds_a_float32_sum_to_the_residual_dtype(impl: Any, dtype: torch.dtype) -> None:
    """The fused MLP hands the next norm a float32 sum; the norm must see what the down GEMM's output in the
    activation dtype would have been, so it equals the norm of that rounded value exactly."""
    if impl is norm_triton.fused_add_rms_norm and CUDA:
        pytest.skip("the GPU test covers the compiled kernel")
    x32, res, w = randn(3, 64, seed=1), randn(3, 64, seed=2, dtype=dtype), randn(64, seed=3, dtype=dtype)
    out, summed = impl(x32, res, w, 1e-6)
    want_out, want_sum = impl(x32.to(dtype), res, w, 1e-6)
    assert summed.dtype == out.dtype == dtype
    assert torch.equal(summed, want_sum) and torch.equal(out, want_out)


# --- GPU: compiled, bf16 -----------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 8, 16])
def test_gpu_fused_mlp_matches_unfused(m: int) -> None:
    x, w13, w2 = (t.to(torch.bfloat16).cuda() for t in mlp_inputs(m, 1024, 3072, seed=m))
    ref = fused_mlp_torch(x.float(), w13.float(), w2.float())
    # bf16 inputs, gate/up and the activation rounded to bf16 (the sum stays float32), as the unfused path.
    assert rel_err(fused_mlp_triton.fused_mlp(x, w13, w2), ref) < 5 * unit_roundoff(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_fused_mlp_applies_only_to_small_batches_when_switched_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    small, large = torch.zeros(FUSED_MLP_MAX_ROWS, 8, device="cuda"), torch.zeros(17, 8, device="cuda")
    monkeypatch.delenv("KUBESGL_FUSED_MLP", raising=False)
    assert not fused_mlp_applies(small)
    monkeypatch.setenv("KUBESGL_FUSED_MLP", "1")
    assert fused_mlp_applies(small) and not fused_mlp_applies(large)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_decoder_mlp_and_next_norm_agree_with_the_switch_on_and_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The decoder's MLP hands the fused path's float32 sum to the next residual norm: both outputs of that
    norm (the normed input and the residual stream) match the unfused path's."""
    mlp = DenseMLP(1024, 3072, bias=False, tp=TPGroup()).to("cuda", torch.bfloat16)
    x, w13, w2 = mlp_inputs(4, 1024, 3072, seed=40)
    mlp.gate_up_proj.weight.data.copy_(w13)
    mlp.down_proj.weight.data.copy_(w2)
    x = x.to("cuda", torch.bfloat16)
    res = randn(4, 1024, seed=41, dtype=torch.bfloat16).cuda()
    w = (1 + randn(1024, seed=42, scale=0.1)).to("cuda", torch.bfloat16)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("KUBESGL_FUSED_MLP", on)
        y = mlp(x)
        assert y.dtype == (torch.float32 if on == "1" else torch.bfloat16)
        outs[on] = fused_add_rms_norm(y, res, w, 1e-6)
    for fused, plain in zip(outs["1"], outs["0"], strict=True):
        assert rel_err(fused, plain) < 5 * unit_roundoff(torch.bfloat16)
