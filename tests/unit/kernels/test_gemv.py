"""The Triton small-batch GEMV (kernels/gemv_triton.py) and its fused prologues against F.linear and the
unfused ops, and a decoder whose projections run through it against the same decoder on F.linear.

Without CUDA the kernel runs in Triton's interpreter on float32 CPU tensors at tiny shapes, with pinned
tilings that exercise split-K (the last program of a tile reduces); on a CUDA machine the `gpu` tests run
it compiled and autotuned in bf16 on Qwen3-0.6B's shapes, and inside a CUDA graph.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn.functional as F
from kubesgl.kernels.activation import silu_and_mul, silu_and_mul_torch
from kubesgl.kernels.gemv import TRITON_MAX_ROWS, LinearBackend
from kubesgl.kernels.gemv_triton import (
    CONFIGS,
    MAX_M,
    PROLOGUE_RMSNORM,
    PROLOGUE_SILU_MUL,
    GemvConfig,
    candidate_configs,
    gemv,
    m_bucket,
)
from kubesgl.kernels.norm import fused_add_rms_norm, rms_norm_torch
from test_kernels import randn, rel_err

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernel compiled")

# Tilings for the interpreter: whole K per program, and K cut into 3 or 4 slices (some rows past M masked).
PINNED = [GemvConfig(16, 16, 32, 1, 4, 1), GemvConfig(16, 32, 64, 3, 4, 1), GemvConfig(32, 16, 32, 4, 4, 1)]
TINY = [(1, 48, 64), (5, 100, 300), (33, 40, 96)]  # (M, N, K): N and K not multiples of the tiles


def split_counters_are_zero() -> bool:
    from kubesgl.kernels.gemv_triton import _WORKSPACE

    return all(bool((ws[2] == 0).all()) for ws in _WORKSPACE._by_device.values())


@cpu_interpreter
@pytest.mark.parametrize("config", PINNED, ids=["whole_k", "split3", "split4_bm32"])
@pytest.mark.parametrize("shape", TINY, ids=["m1", "m5", "m33"])
def test_gemv_matches_f_linear_with_and_without_bias(config: GemvConfig, shape: tuple[int, int, int]) -> None:
    m, n, k = shape
    x, w, b = randn(m, k, seed=1), randn(n, k, seed=2), randn(n, seed=3)
    y, residual = gemv(x, w, b, config=config)
    assert residual is None
    assert rel_err(y, F.linear(x, w, b)) < 1e-5
    assert rel_err(gemv(x, w, config=config)[0], F.linear(x, w)) < 1e-5
    assert split_counters_are_zero()  # the reducing program left its tile's counter for the next launch


@cpu_interpreter
@pytest.mark.parametrize("config", PINNED, ids=["whole_k", "split3", "split4_bm32"])
@pytest.mark.parametrize("shape", TINY, ids=["m1", "m5", "m33"])
def test_gemv_norm_prologue_equals_add_rmsnorm_then_linear(
    config: GemvConfig, shape: tuple[int, int, int]
) -> None:
    m, n, k = shape
    x, res, nw, w = randn(m, k, seed=4), randn(m, k, seed=5), randn(k, seed=6), randn(n, k, seed=7)
    y, summed = gemv(x, w, prologue=PROLOGUE_RMSNORM, residual=res, norm_weight=nw, eps=1e-6, config=config)
    assert torch.equal(summed, x + res)  # every K-slice of every row written once, by the column-0 programs
    assert rel_err(y, F.linear(rms_norm_torch(x + res, nw, 1e-6), w)) < 1e-5
    y, same = gemv(x, w, prologue=PROLOGUE_RMSNORM, norm_weight=nw, eps=1e-6, config=config)
    assert same is x  # no residual yet (the first layer): the input is the residual stream
    assert rel_err(y, F.linear(rms_norm_torch(x, nw, 1e-6), w)) < 1e-5


@cpu_interpreter
@pytest.mark.parametrize("config", PINNED, ids=["whole_k", "split3", "split4_bm32"])
def test_gemv_silu_prologue_equals_silu_and_mul_then_linear(config: GemvConfig) -> None:
    m, n, k = 5, 40, 96
    x, w, b = randn(m, 2 * k, seed=8), randn(n, k, seed=9), randn(n, seed=10)
    y, _ = gemv(x, w, b, prologue=PROLOGUE_SILU_MUL, config=config)
    assert rel_err(y, F.linear(silu_and_mul_torch(x), w, b)) < 1e-5


def test_gemv_rejects_shapes_it_cannot_take() -> None:
    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="does not fit weight"):
        gemv(torch.zeros(2, 15), w)
    with pytest.raises(ValueError, match="does not fit weight"):
        gemv(torch.zeros(2, 16), w, prologue=PROLOGUE_SILU_MUL)  # needs [gate | up] rows of 32
    with pytest.raises(ValueError, match=f"1..{MAX_M} rows"):
        gemv(torch.zeros(MAX_M + 1, 16), w)
    with pytest.raises(ValueError, match="dense"):
        gemv(torch.zeros(2, 16), torch.zeros(16, 8).t())


def test_candidate_configs_fit_the_bucket_and_leave_no_k_slice_empty() -> None:
    rng = random.Random(0)
    for _ in range(200):
        m, n, k = (
            rng.randint(1, MAX_M),
            rng.choice([64, 1024, 4096, 6144, 151936]),
            rng.choice([64, 1024, 3072]),
        )
        cands = candidate_configs(m, n, k, num_sms=132)
        assert cands and set(cands) <= set(CONFIGS)
        assert cands == candidate_configs(m_bucket(m), n, k, num_sms=132)  # one autotuning result per bucket
        bucket = m_bucket(m)
        for c in cands:
            assert c.block_m <= bucket  # no tile of rows that are all padding
            k_len = math.ceil(math.ceil(k / c.split_k) / c.block_k) * c.block_k
            assert c.split_k == 1 or (c.split_k - 1) * k_len < k


def test_linear_backend_names_and_which_batches_it_takes() -> None:
    with pytest.raises(ValueError, match="choose one of torch, triton, auto"):
        LinearBackend("cublas")
    x = torch.zeros(4, 8)
    assert not LinearBackend("torch").takes(x)
    assert not LinearBackend("auto").takes(x)  # auto is CUDA only
    assert not LinearBackend("triton").takes(torch.zeros(MAX_M + 1, 8))
    assert not LinearBackend("triton").takes(torch.zeros(0, 8))
    assert TRITON_MAX_ROWS == MAX_M  # the dispatcher's bound (kept free of the triton import) is the kernel's


def test_gemv_of_an_empty_batch_is_empty() -> None:
    y, _ = gemv(torch.zeros(0, 16), torch.zeros(8, 16))
    assert y.shape == (0, 8)


# --- a decoder on the GEMV (interpreter) -------------------------------------------------------------


@cpu_interpreter
@pytest.mark.parametrize("arch", ["qwen3", "qwen2", "qwen3_moe"])
@pytest.mark.slow  # 15-130 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_decoder_on_the_triton_gemv_equals_the_decoder_on_f_linear(
    arch: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A prefill and decode steps through the fused layer (qkv(norm) -> attention -> o -> gate_up(norm) ->
    down(silu), the LM head on the GEMV) give the logits of the unfused layer: Qwen3 (q/k norm, tied head),
    Qwen2 (qkv bias), Qwen3-MoE (its sparse layers keep the separate norm)."""
    from kubesgl.distributed import TPGroup
    from kubesgl.models.loader import load_model
    from kubesgl.models.random_init import build_random_model
    from support.model_helpers import SingleRequestRunner

    path = build_random_model(arch, tmp_path_factory.mktemp(arch))
    tokens = [random.Random(1).randrange(512) for _ in range(9)]
    logits = {}
    for backend in ("torch", "triton"):
        model = load_model(path, tp=TPGroup(), device="cpu", dtype=torch.float32)
        model.set_linear_backend(backend)
        runner = SingleRequestRunner(model, page_size=4, max_tokens=16)
        steps = [runner.step(tokens[:6])] + [runner.step([t]) for t in tokens[6:]]
        logits[backend] = torch.cat(steps)
        layer = model.model.layers[0]
        assert layer.self_attn.qkv_proj.backend.takes(steps[-1]) == (backend == "triton")
    assert rel_err(logits["triton"], logits["torch"]) < 1e-5
    assert not torch.equal(logits["triton"], logits["torch"])  # other kernels ran: another summation order


# --- GPU: compiled, autotuned, bf16, real shapes ------------------------------------------------------

needs_cuda = pytest.mark.skipif(not CUDA, reason="needs CUDA")
QWEN3_06B = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
GPU_ROWS = [1, 7, 32, 64, 100, 256]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", GPU_ROWS)
def test_gpu_gemv_matches_torch_on_qwen3_shapes(rows: int) -> None:
    bf16 = torch.bfloat16
    for i, (name, (n, k)) in enumerate(QWEN3_06B.items()):
        w = randn(n, k, seed=20 + i, dtype=bf16, device="cuda") * k**-0.5
        if name in ("qkv", "gate_up"):
            x, res = (randn(rows, k, seed=30 + i + j, dtype=bf16, device="cuda") for j in (0, 1))
            nw = 1 + 0.1 * randn(k, seed=40 + i, dtype=bf16, device="cuda")
            y, summed = gemv(x, w, prologue=PROLOGUE_RMSNORM, residual=res, norm_weight=nw, eps=1e-6)
            normed, ref_sum = fused_add_rms_norm(x, res, nw, 1e-6)
            assert torch.equal(summed, ref_sum), name
            ref = F.linear(normed, w)
        elif name == "down":
            x = randn(rows, 2 * k, seed=50, dtype=bf16, device="cuda")
            y, _ = gemv(x, w, prologue=PROLOGUE_SILU_MUL)
            ref = F.linear(silu_and_mul(x), w)
        else:
            x = randn(rows, k, seed=60, dtype=bf16, device="cuda")
            y, _ = gemv(x, w)
            ref = F.linear(x, w)
        assert rel_err(y, ref) < 1e-2, name
    assert split_counters_are_zero()


@pytest.mark.gpu
@needs_cuda
def test_gpu_gemv_replays_in_a_cuda_graph_with_split_k() -> None:
    """Every tiling (split-K ones included: their counters must be back at zero for the next replay) inside
    one graph, replayed on new inputs."""
    bf16, rows, (n, k) = torch.bfloat16, 8, QWEN3_06B["down"]
    w = randn(n, k, seed=70, dtype=bf16, device="cuda") * k**-0.5
    fits = [c for c in CONFIGS if c.block_m == 16]
    x = randn(rows, k, seed=71, dtype=bf16, device="cuda")
    for c in fits:  # compile outside the capture
        gemv(x, w, config=c)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [gemv(x, w, config=c)[0] for c in fits]
    for seed in (72, 73):
        x.copy_(randn(rows, k, seed=seed, dtype=bf16, device="cuda"))
        graph.replay()
        ref = F.linear(x, w)
        for c, y in zip(fits, outs, strict=True):
            assert rel_err(y, ref) < 1e-2, c
