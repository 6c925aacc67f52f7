"""The small-batch projection kernel (kernels/gemv.py) against F.linear.

Without CUDA the kernel runs in Triton's interpreter on float32 CPU tensors; the `gpu` tests run it compiled in
bf16 at Qwen3-0.6B's projection shapes, inside a CUDA graph with PDL (the decode graphs' setting), and the
decoder's projections with the switch on against off.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from kubesgl import env
from kubesgl.distributed import TPGroup
from kubesgl.kernels import gemv as gemv_module
from kubesgl.kernels import gemv_triton, norm_triton
from kubesgl.kernels.activation_triton import silu_and_mul
from kubesgl.kernels.gemv import GEMV_MAX_K, GEMV_MAX_ROWS, gate_up_silu, gemv_applies, linear, norm_linear
from kubesgl.kernels.norm import rms_norm_torch
from kubesgl.layers.linear import QKVParallelLinear, RowParallelLinear
from kubesgl.layers.norm import RMSNorm
from kubesgl.models.decoder import DenseMLP
from kubesgl.models.loader import load_model
from kubesgl.models.random_init import build_random_model
from support.model_helpers import SingleRequestRunner
from support.numerics import logits_tolerance, randn, rel_err, reorder_bound, unit_roundoff
from transformers import AutoModelForCausalLM

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernel compiled")


@cpu_interpreter
@pytest.mark.parametrize(("m", "n", "k"), [(1, 40, 96), (3, 17, 64), (4, 8, 200)])
def test_triton_gemv_matches_linear(m: int, n: int, k: int) -> None:
    """Widths that are not powers of two (masked columns and a masked weight slice)."""
    x, w = randn(m, k, seed=m), randn(n, k, seed=n, scale=k**-0.5)
    out = gemv_triton.gemv(x, w)
    assert out.dtype == torch.float32
    assert rel_err(out, F.linear(x, w)) < reorder_bound(torch.float32, k)


@cpu_interpreter
@pytest.mark.parametrize(("m", "n", "k"), [(1, 24, 96), (3, 7, 64), (4, 5, 200)])
def test_triton_gemv_silu_mul_matches_projection_then_silu_mul(m: int, n: int, k: int) -> None:
    """The [gate; up] halves are found at N rows apart, whatever N's width (masked rows and columns)."""
    x, w = randn(m, k, seed=m), randn(2 * n, k, seed=n, scale=k**-0.5)
    out = gemv_triton.gemv_silu_mul(x, w)
    assert out.shape == (m, n) and out.dtype == torch.float32
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    # silu(g) * u moves with g by at most |u| * max|silu'| (< 1.1) and with u by |silu(g)| (< |g| + 0.3).
    assert rel_err(out, F.silu(gate) * up) < 4 * reorder_bound(torch.float32, k)


@cpu_interpreter
@pytest.mark.parametrize(
    ("m", "with_residual", "silu"), [(1, True, False), (3, True, True), (2, False, True)]
)
def test_triton_norm_gemv_matches_norm_then_projection(m: int, with_residual: bool, silu: bool) -> None:
    """The RMSNorm (and residual add) inside the GEMV against the torch norm, then F.linear (then silu·mul);
    K = 200 is not a power of two, so the norm's sum is masked too."""
    k, n = 200, 24
    x, res = randn(m, k, seed=m), randn(m, k, seed=m + 10)
    norm_w, w = randn(k, seed=3) + 1.0, randn(2 * n if silu else n, k, seed=4, scale=k**-0.5)
    out, summed = gemv_triton.norm_gemv(x, res if with_residual else None, norm_w, 1e-6, w, silu=silu)
    want_sum = x + res if with_residual else x
    assert torch.equal(summed, want_sum)  # program 0's store; the input itself without a residual
    ref = F.linear(rms_norm_torch(want_sum, norm_w, 1e-6), w)
    if silu:
        gate, up = ref.chunk(2, dim=-1)
        ref = F.silu(gate) * up
    assert rel_err(out, ref) < 4 * reorder_bound(torch.float32, k)


def test_norm_gemv_needs_the_norm_weight_and_the_residual_in_x_dtype() -> None:
    with pytest.raises(ValueError, match="norm weight"):
        gemv_triton.norm_gemv(
            torch.zeros(1, 4), None, torch.ones(4, dtype=torch.float64), 1e-6, torch.zeros(2, 4)
        )
    with pytest.raises(ValueError, match="residual torch.float64"):
        gemv_triton.norm_gemv(
            torch.zeros(1, 4), torch.zeros(1, 4, dtype=torch.float64), torch.ones(4), 1e-6, torch.zeros(2, 4)
        )


def test_gemv_silu_mul_needs_gate_and_up_halves() -> None:
    with pytest.raises(ValueError, match="not \\[gate; up\\]"):
        gemv_triton.gemv_silu_mul(torch.zeros(1, 4), torch.zeros(3, 4))


def test_gate_up_silu_stays_off_on_cpu_and_when_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = randn(1, 16, seed=1), randn(8, 16, seed=2)
    monkeypatch.delenv("KUBESGL_GEMV", raising=False)
    monkeypatch.delenv("KUBESGL_GEMV_SILU", raising=False)
    assert gate_up_silu(x, w) is None  # a CPU tensor
    assert norm_linear(x, None, torch.ones(16), 1e-6, w) is None  # a CPU tensor
    monkeypatch.delenv("KUBESGL_GEMV_NORM", raising=False)
    assert env.gemv() and env.gemv_silu() and env.gemv_norm()  # every fold on by default
    monkeypatch.setenv("KUBESGL_GEMV_SILU", "0")
    monkeypatch.setenv("KUBESGL_GEMV_NORM", "false")
    assert not env.gemv_silu() and not env.gemv_norm()


@cpu_interpreter
def test_the_folds_decline_a_bias_and_take_the_rest(monkeypatch: pytest.MonkeyPatch) -> None:
    """A projection with a bias keeps the separate kernels (the GEMV adds none); without one the same call
    runs the fold. CUDA's part is played by a named stand-in, as in the decoder test below."""
    monkeypatch.setattr(gemv_module, "use_triton", lambda x: True)  # stand-in for a CUDA device
    monkeypatch.delenv("KUBESGL_GEMV_NORM", raising=False)
    x, w, b, nw = randn(1, 16, seed=1), randn(8, 16, seed=2), randn(8, seed=3), torch.ones(16)
    assert gate_up_silu(x, w) is not None and gate_up_silu(x, w, b) is None
    assert norm_linear(x, None, nw, 1e-6, w) is not None and norm_linear(x, None, nw, 1e-6, w, b) is None


def test_gemv_rejects_more_rows_or_mismatched_widths() -> None:
    with pytest.raises(ValueError, match="at most 8 rows"):
        gemv_triton.gemv(torch.zeros(9, 4), torch.zeros(3, 4))
    with pytest.raises(ValueError, match="x \\(2, 4\\) and w \\(3, 5\\)"):
        gemv_triton.gemv(torch.zeros(2, 4), torch.zeros(3, 5))


def test_linear_stays_on_torch_off_cuda_or_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w, b = randn(2, 16, seed=1), randn(8, 16, seed=2), randn(8, seed=3)
    monkeypatch.delenv("KUBESGL_GEMV", raising=False)
    assert env.gemv() and env.gemv_silu()  # on by default
    assert not gemv_applies(x, w)  # a CPU tensor
    assert torch.equal(linear(x, w, b), F.linear(x, w, b))
    for off in ("0", "false"):
        monkeypatch.setenv("KUBESGL_GEMV", off)
        assert not env.gemv()
    assert torch.equal(linear(x, w), F.linear(x, w))


# --- GPU: compiled, bf16 -----------------------------------------------------------------------------

QWEN3_06B = [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]  # (K, N): qkv, o, gate_up, down


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 2, 4])
@pytest.mark.parametrize(("k", "n"), QWEN3_06B)
def test_gpu_gemv_matches_linear(m: int, k: int, n: int) -> None:
    x = randn(m, k, seed=m).to("cuda", torch.bfloat16)
    w = randn(n, k, seed=k + n, scale=k**-0.5).to("cuda", torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    # bf16 inputs, float32 sums, one rounding to bf16 at the end.
    assert rel_err(gemv_triton.gemv(x, w), ref) < 2 * unit_roundoff(torch.bfloat16) + reorder_bound(
        torch.float32, k
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_gemv_in_a_graph_after_another_kernel_reads_that_kernels_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """PDL: the kernel reads its weights before waiting, its input only after; replayed in a CUDA graph behind
    the kernel that writes the input, it must see the new input every replay."""
    monkeypatch.setenv("KUBESGL_GEMV", "1")
    w = randn(4096, 1024, seed=7, scale=1024**-0.5).to("cuda", torch.bfloat16)
    src = torch.zeros(1, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            torch.mul(src, 2, out=x)
            linear(x, w)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 2, out=x)
        out = linear(x, w)
    for seed in range(5):
        src.copy_(randn(1, 1024, seed=seed).to(torch.bfloat16))
        graph.replay()
        assert rel_err(out, F.linear(2 * src.float(), w.float())) < 4 * unit_roundoff(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_projections_agree_with_the_switch_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    tp = TPGroup()
    qkv = QKVParallelLinear(1024, 128, 16, 8, bias=False, tp=tp).to("cuda", torch.bfloat16)
    o = RowParallelLinear(2048, 1024, bias=False, tp=tp).to("cuda", torch.bfloat16)
    for i, layer in enumerate((qkv, o)):
        layer.weight.data.copy_(randn(*layer.weight.shape, seed=i, scale=layer.weight.shape[1] ** -0.5))
    for m in (1, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1):
        x = randn(m, 1024, seed=m).to("cuda", torch.bfloat16)
        monkeypatch.setenv("KUBESGL_GEMV", "1")
        assert gemv_applies(x, qkv.weight) == (m <= GEMV_MAX_ROWS)
        on = qkv(x), o(torch.cat([x, x], 1))
        monkeypatch.setenv("KUBESGL_GEMV", "0")
        off = qkv(x), o(torch.cat([x, x], 1))
        for a, b in zip(on, off, strict=True):
            assert rel_err(a, b) < 4 * unit_roundoff(torch.bfloat16)
    assert not gemv_applies(
        torch.zeros(1, GEMV_MAX_K + 1, device="cuda"), torch.zeros(8, GEMV_MAX_K + 1, device="cuda")
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 3])
def test_gpu_gemv_silu_mul_matches_the_two_kernels(m: int) -> None:
    """Qwen3-0.6B's gate_up (K 1024, 2 x 3072): the fused kernel against the projection, rounded to bf16, then
    the SiLU·mul kernel, each rounding where the two-kernel path rounds."""
    x = randn(m, 1024, seed=m).to("cuda", torch.bfloat16)
    w = randn(6144, 1024, seed=11, scale=1024**-0.5).to("cuda", torch.bfloat16)
    two_kernels = silu_and_mul(F.linear(x.float(), w.float()).to(torch.bfloat16))
    assert rel_err(gemv_triton.gemv_silu_mul(x, w), two_kernels) < 4 * unit_roundoff(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_dense_mlp_agrees_with_the_silu_gemv_on_and_off(monkeypatch: pytest.MonkeyPatch) -> None:
    mlp = DenseMLP(1024, 3072, bias=False, tp=TPGroup()).to("cuda", torch.bfloat16)
    for i, layer in enumerate((mlp.gate_up_proj, mlp.down_proj)):
        layer.weight.data.copy_(randn(*layer.weight.shape, seed=i, scale=layer.weight.shape[1] ** -0.5))
    x = randn(2, 1024, seed=5).to("cuda", torch.bfloat16)
    monkeypatch.setenv("KUBESGL_GEMV", "1")
    monkeypatch.setenv("KUBESGL_GEMV_SILU", "1")
    assert gate_up_silu(x, mlp.gate_up_proj.weight) is not None
    on = mlp(x)
    monkeypatch.setenv("KUBESGL_GEMV_SILU", "0")
    assert gate_up_silu(x, mlp.gate_up_proj.weight) is None
    # down's sums over 3072 terms, each input within a bf16 rounding of the other path's.
    assert rel_err(on, mlp(x)) < 8 * unit_roundoff(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 4])
def test_gpu_norm_gemv_matches_the_norm_kernel_then_the_gemv(m: int) -> None:
    """Qwen3-0.6B's input norm and qkv (K 1024, N 4096) in bf16: the residual stream is the norm kernel's, bit
    for bit; the projection is within a bf16 rounding of the two kernels' (the norm's sum of squares may
    land in another order, and one bf16 rounding of the normed input may then differ)."""
    x = randn(m, 1024, seed=m).to("cuda", torch.bfloat16)
    res = randn(m, 1024, seed=m + 1).to("cuda", torch.bfloat16)
    norm_w = (randn(1024, seed=2) * 0.1 + 1.0).to("cuda", torch.bfloat16)
    w = randn(4096, 1024, seed=3, scale=1024**-0.5).to("cuda", torch.bfloat16)
    normed, summed = norm_triton.fused_add_rms_norm(x, res, norm_w, 1e-6)
    out, fused_sum = gemv_triton.norm_gemv(x, res, norm_w, 1e-6, w)
    assert torch.equal(fused_sum, summed)
    assert rel_err(out, gemv_triton.gemv(normed, w)) < 4 * unit_roundoff(torch.bfloat16)
    first, same_x = gemv_triton.norm_gemv(x, None, norm_w, 1e-6, w)  # the first layer: no residual yet
    assert same_x is x
    assert rel_err(first, gemv_triton.gemv(norm_triton.rms_norm(x, norm_w, 1e-6), w)) < 4 * unit_roundoff(
        torch.bfloat16
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_dense_mlp_after_its_norm_agrees_with_the_norm_then_the_mlp(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    mlp = DenseMLP(1024, 3072, bias=False, tp=TPGroup()).to("cuda", torch.bfloat16)
    norm = RMSNorm(1024).to("cuda", torch.bfloat16)
    norm.weight.data.copy_(randn(1024, seed=9) * 0.1 + 1.0)
    for i, layer in enumerate((mlp.gate_up_proj, mlp.down_proj)):
        layer.weight.data.copy_(randn(*layer.weight.shape, seed=i, scale=layer.weight.shape[1] ** -0.5))
    x, res = (randn(2, 1024, seed=s).to("cuda", torch.bfloat16) for s in (5, 6))
    for var in ("KUBESGL_GEMV", "KUBESGL_GEMV_SILU"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("KUBESGL_GEMV_NORM", "1")
    fused = mlp.after_norm(x, res, norm)
    assert fused is not None
    normed, summed = norm(x, res)
    assert torch.equal(fused[1], summed)
    assert rel_err(fused[0], mlp(normed)) < 8 * unit_roundoff(torch.bfloat16)
    monkeypatch.setenv("KUBESGL_GEMV_NORM", "0")
    assert mlp.after_norm(x, res, norm) is None


# --- The decoder's wiring, on CPU: the GEMV and every fold in Triton's interpreter --------------------------


@cpu_interpreter
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_decode_steps_through_every_gemv_fold_match_hf(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A small random model's decode steps (one row each) with the GEMV, the SiLU fold and the norm folds on,
    against HF. CUDA's part is played by a named stand-in: `kernels.gemv.use_triton` accepts CPU tensors, so the
    interpreter runs the kernels; everything else takes its CPU path. The calls are counted, so the test fails
    if the decoder stops reaching them."""
    monkeypatch.setattr(gemv_module, "use_triton", lambda x: True)  # stand-in for a CUDA device
    for var in ("KUBESGL_GEMV", "KUBESGL_GEMV_SILU", "KUBESGL_GEMV_NORM"):
        monkeypatch.setenv(var, "1")
    calls: Counter[tuple[bool, bool, bool]] = Counter()
    launch = gemv_triton._launch

    def counted(x: torch.Tensor, w: torch.Tensor, **kw: Any) -> Any:
        calls[(kw.get("norm_weight") is not None, kw.get("residual") is not None, kw.get("silu", False))] += 1
        return launch(x, w, **kw)

    monkeypatch.setattr(gemv_triton, "_launch", counted)
    checkpoint = build_random_model(arch, tmp_path / arch, overrides={"num_hidden_layers": 2})
    model = load_model(checkpoint)
    ids = torch.randint(0, model.vocab_size, (16,), generator=torch.Generator().manual_seed(3)).tolist()
    runner = SingleRequestRunner(model, 16)
    steps = [runner.step(ids[:12])] + [runner.step([t]) for t in ids[12:]]
    hf = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    tol = logits_tolerance(checkpoint, context=len(ids))
    torch.testing.assert_close(torch.cat(steps), ref, rtol=0, atol=tol)
    decode_steps, layers = 4, 2
    assert calls == {
        (True, False, False): decode_steps,  # layer 0's input norm (no residual yet) in its qkv GEMV
        (True, True, False): decode_steps * (layers - 1),  # the later layers' input norms
        (True, True, True): decode_steps * layers,  # the residual norm and SiLU·mul in gate_up's GEMV
        (False, False, False): decode_steps * layers * 2,  # o and down
    }
