"""The mid-batch GEMM (kernels/gemm_triton.py) and its dispatch (kernels/gemv.py's `skinny_config`).

Without CUDA the kernel runs in Triton's interpreter on float32 CPU tensors (split-K's counters and its last
program's sum included); the `gpu` tests run it compiled in bf16 at Qwen3-0.6B's projection shapes, replayed in a
CUDA graph with PDL behind the kernel that writes its input, and through `linear` with a table on and off.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kubesgl.kernels import gemm_triton
from kubesgl.kernels import gemv as gemv_module
from kubesgl.kernels.gemm_config import GemmConfig
from kubesgl.kernels.gemv import SKINNY_MAX_ROWS, gate_up_silu, linear, rows_bucket, skinny_config
from support.numerics import randn, rel_err, reorder_bound, unit_roundoff

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernel compiled")


def counters_zero(device: torch.device) -> bool:
    """Every split-K counter buffer of `device` (one per stream) is back at 0."""
    return all(int(c.abs().sum()) == 0 for (dev, _), c in gemm_triton._counters.items() if dev == device)


@cpu_interpreter
@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (5, 40, 96, GemmConfig(16, 16, 32)),  # masked rows and columns, one M block
        (37, 70, 200, GemmConfig(32, 32, 64, 2)),  # two M blocks; K = 200 cut into ranges of 128 and 72
        (20, 48, 256, GemmConfig(16, 16, 32, 4)),  # four splits of whole steps
        (70, 33, 130, GemmConfig(64, 16, 32, 3)),  # three splits, the last one short
    ],
)
def test_skinny_gemm_matches_linear(m: int, n: int, k: int, cfg: GemmConfig) -> None:
    x, w = randn(m, k, seed=m), randn(n, k, seed=n, scale=k**-0.5)
    out = gemm_triton.skinny_gemm(x, w, cfg)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    assert rel_err(out, F.linear(x, w)) < reorder_bound(torch.float32, k)
    assert counters_zero(x.device), "the last program of each tile leaves its counter at 0"


@cpu_interpreter
def test_split_k_output_is_the_ordered_sum_of_the_split_products_on_every_launch() -> None:
    """The last program sums the float32 partials in split order, starting from 0: the output is exactly the
    ordered sum of the split products, the same on every launch."""
    m, n, k, splits = 6, 16, 64, 4
    x, w = randn(m, k, seed=1), randn(n, k, seed=2, scale=k**-0.5)
    cfg = GemmConfig(16, 16, 16, splits)
    parts = [F.linear(x[:, s * 16 : (s + 1) * 16], w[:, s * 16 : (s + 1) * 16]) for s in range(splits)]
    want = torch.zeros(m, n)
    for part in parts:
        want = want + part
    for _ in range(3):
        out = gemm_triton.skinny_gemm(x, w, cfg)
        assert torch.allclose(out, want, rtol=0, atol=4 * unit_roundoff(torch.float32) * want.abs().max())
    assert counters_zero(x.device)


@cpu_interpreter
@pytest.mark.parametrize(("m", "n", "k"), [(9, 24, 64), (33, 20, 96)])
def test_skinny_gemm_silu_matches_projection_then_silu_mul(m: int, n: int, k: int) -> None:
    x, w = randn(m, k, seed=m), randn(2 * n, k, seed=n, scale=k**-0.5)
    out = gemm_triton.skinny_gemm(x, w, GemmConfig(16, 16, 32), silu=True)
    assert out.shape == (m, n)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    # silu(g) * u moves with g by at most |u| * max|silu'| (< 1.1) and with u by |silu(g)| (< |g| + 0.3).
    assert rel_err(out, F.silu(gate) * up) < 4 * reorder_bound(torch.float32, k)


def test_skinny_gemm_refuses_what_it_cannot_run() -> None:
    x, w = torch.zeros(8, 64), torch.zeros(32, 64)
    with pytest.raises(ValueError, match=r"x \(8, 64\) and w \(32, 48\)"):
        gemm_triton.skinny_gemm(x, torch.zeros(32, 48), GemmConfig(16, 16, 16))
    with pytest.raises(ValueError, match="split_k 1"):
        gemm_triton.skinny_gemm(x, w, GemmConfig(16, 16, 16, 2), silu=True)
    with pytest.raises(ValueError, match="one dtype"):
        gemm_triton.skinny_gemm(x.double(), w, GemmConfig(16, 16, 16))


def test_config_keys_round_trip_and_bad_keys_are_refused() -> None:
    cfg = GemmConfig(32, 64, 128, 4, 8, 3)
    assert cfg.key() == "m32n64k128s4w8p3" and GemmConfig.parse(cfg.key()) == cfg
    with pytest.raises(ValueError, match="not a GEMM config key"):
        GemmConfig.parse("m32n64")


def test_rows_bucket_is_the_power_of_two_at_or_above_at_least_8() -> None:
    assert [rows_bucket(m) for m in (5, 8, 9, 16, 17, 100, 128, 129, 256)] == [
        8,
        8,
        16,
        16,
        32,
        128,
        128,
        256,
        256,
    ]


def test_a_sweeps_table_is_read_by_shape_and_bucket(tmp_path: Path) -> None:
    path = tmp_path / "table.json"
    path.write_text(
        json.dumps({"configs": {"4096,1024,0,64": "m64n64k128s1w4p3", "3072,1024,1,8": "m16n32k64s1w4p4"}})
    )
    table = gemv_module._table_from(str(path))
    assert table == {
        (4096, 1024, False, 64): GemmConfig(64, 64, 128, 1, 4, 3),
        (3072, 1024, True, 8): GemmConfig(16, 32, 64, 1, 4, 4),
    }


@cpu_interpreter
def test_no_config_off_cuda_so_cpu_projections_keep_f_linear(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On CPU (and for float32, and outside 5-256 rows) `linear` stays F.linear, bit for bit, table or not."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"configs": {"32,64,0,8": "m16n16k16s1w4p3"}}))
    monkeypatch.setenv("KUBESGL_SKINNY_CONFIGS", str(path))
    x, w = randn(8, 64, seed=1), randn(32, 64, seed=2)
    assert skinny_config(x, w) is None and skinny_config(x.bfloat16(), w.bfloat16()) is None
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert gate_up_silu(x, randn(64, 64, seed=3)) is None


# --- GPU ----------------------------------------------------------------------------------------------------

SHAPES = {"qkv": (4096, 1024), "o": (1024, 2048), "gate_up": (6144, 1024), "down": (1024, 3072)}
GPU_CONFIGS = [
    GemmConfig(16, 32, 128),
    GemmConfig(16, 64, 128, 4),
    GemmConfig(64, 64, 64, 2, 4, 4),
    GemmConfig(128, 64, 128, 1, 8, 3),
    GemmConfig(64, 32, 128, 8),
]


def bf16_bound(k: int) -> float:
    """The output's bf16 rounding plus float32 sums in another order than the float32 reference's."""
    return 2 * unit_roundoff(torch.bfloat16) + reorder_bound(torch.float32, k)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("m", [5, 16, 37, 64, 100, 256])
def test_gpu_skinny_gemm_matches_linear_at_the_models_shapes(name: str, m: int) -> None:
    n, k = SHAPES[name]
    x = randn(m, k, seed=m).to("cuda", torch.bfloat16)
    w = randn(n, k, seed=n, scale=k**-0.5).to("cuda", torch.bfloat16)
    ref = F.linear(x.float(), w.float())
    for cfg in GPU_CONFIGS:
        if k // cfg.split_k < cfg.block_k:
            continue
        out = gemm_triton.skinny_gemm(x, w, cfg)
        assert rel_err(out, ref) < bf16_bound(k), cfg
        assert torch.equal(gemm_triton.skinny_gemm(x, w, cfg), out), f"{cfg}: not the same on a second launch"
    assert counters_zero(x.device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [8, 48, 256])
def test_gpu_skinny_gemm_silu_matches_the_two_kernels(m: int) -> None:
    from kubesgl.kernels.activation_triton import silu_and_mul

    x = randn(m, 1024, seed=m).to("cuda", torch.bfloat16)
    w = randn(6144, 1024, seed=5, scale=1024**-0.5).to("cuda", torch.bfloat16)
    want = silu_and_mul(F.linear(x, w))
    out = gemm_triton.skinny_gemm(x, w, GemmConfig(16 if m <= 16 else 64, 32, 128), silu=True)
    # Each projection is rounded to bf16 where the GEMM rounds, then silu·mul as the kernel computes it: the two
    # differ only by the GEMMs' float32 sums in another order, a bf16 step at a rounding boundary.
    assert rel_err(out, want) < 2 * unit_roundoff(torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("cfg", [GemmConfig(64, 64, 128, 4), GemmConfig(16, 32, 128)], ids=lambda c: c.key())
def test_gpu_skinny_gemm_in_a_graph_after_another_kernel_reads_that_kernels_output(cfg: GemmConfig) -> None:
    """PDL: the first weight tile is read before the wait, the input after it; replayed in a CUDA graph behind the
    kernel that writes the input, every replay must see the new input, and split-K's counters stay zeroed."""
    w = randn(1024, 3072, seed=7, scale=3072**-0.5).to("cuda", torch.bfloat16)
    src = torch.zeros(40, 3072, device="cuda", dtype=torch.bfloat16)
    x = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for _ in range(2):
            torch.mul(src, 2, out=x)
            gemm_triton.skinny_gemm(x, w, cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 2, out=x)
        out = gemm_triton.skinny_gemm(x, w, cfg)
        out2 = gemm_triton.skinny_gemm(x, w, cfg)  # a second launch on the same counters
    for seed in range(5):
        src.copy_(randn(40, 3072, seed=seed).to(torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, F.linear(2 * src.float(), w.float())) < bf16_bound(3072)
        assert torch.equal(out, out2)
    assert counters_zero(x.device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_split_k_on_two_streams_at_once_keeps_each_launchs_tiles_apart() -> None:
    """Two half-batches' GEMMs on two streams of one graph run at the same time: each stream counts on its own
    counters, so no launch takes the other's increments for its own parts (a shared buffer would sum early)."""
    cfg = GemmConfig(64, 64, 128, 4)
    w = randn(1024, 3072, seed=7, scale=3072**-0.5).to("cuda", torch.bfloat16)
    xa = randn(100, 3072, seed=1).to("cuda", torch.bfloat16)
    xb = randn(100, 3072, seed=2).to("cuda", torch.bfloat16)
    side = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        outs_a = [gemm_triton.skinny_gemm(xa, w, cfg) for _ in range(8)]
        with torch.cuda.stream(side):
            outs_b = [gemm_triton.skinny_gemm(xb, w, cfg) for _ in range(8)]
        main.wait_stream(side)
    for _ in range(5):
        graph.replay()
        torch.cuda.synchronize()
        for out in outs_a:
            assert rel_err(out, F.linear(xa.float(), w.float())) < bf16_bound(3072)
        for out in outs_b:
            assert rel_err(out, F.linear(xb.float(), w.float())) < bf16_bound(3072)
    assert counters_zero(xa.device)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_linear_takes_the_tables_config_and_agrees_with_cublas(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    path = tmp_path / "table.json"
    path.write_text(
        json.dumps({"configs": {"1024,2048,0,64": "m64n64k128s4w4p3", "3072,1024,1,64": "m64n32k128s1w4p3"}})
    )
    monkeypatch.setenv("KUBESGL_SKINNY_CONFIGS", str(path))
    x = randn(60, 2048, seed=1).to("cuda", torch.bfloat16)
    w = randn(1024, 2048, seed=2, scale=2048**-0.5).to("cuda", torch.bfloat16)
    assert skinny_config(x, w) == GemmConfig(64, 64, 128, 4)
    assert (
        skinny_config(x[:4], w) is None and skinny_config(x[:30], w) is None
    )  # the GEMV's rows; no 32 bucket
    assert (
        skinny_config(torch.zeros(SKINNY_MAX_ROWS + 1, 2048, device="cuda", dtype=torch.bfloat16), w) is None
    )
    assert rel_err(linear(x, w), F.linear(x, w)) < 2 * bf16_bound(2048)
    gate_up = randn(6144, 1024, seed=3, scale=1024**-0.5).to("cuda", torch.bfloat16)
    xg = randn(50, 1024, seed=4).to("cuda", torch.bfloat16)
    act = gate_up_silu(xg, gate_up)
    assert act is not None and act.shape == (50, 3072)
    monkeypatch.setenv("KUBESGL_SKINNY_GEMM", "0")
    assert skinny_config(x, w) is None and gate_up_silu(xg, gate_up) is None
    torch.testing.assert_close(linear(x, w), F.linear(x, w), rtol=0, atol=0)


def test_the_built_in_table_names_configs_the_kernel_can_launch() -> None:
    """Every entry parses, a SiLU-folded one has no K split, and split-K's output tiles fit the counters."""
    table = gemv_module._table_from(None)
    assert len(table) == len(gemv_module.SKINNY_TABLE) > 0
    for (n, k, silu, bucket), cfg in table.items():
        assert bucket == rows_bucket(bucket) and 8 <= bucket <= SKINNY_MAX_ROWS
        assert not silu or cfg.split_k == 1
        assert k // cfg.split_k >= cfg.block_k, (n, k, cfg)
        tiles = -(-bucket // cfg.block_m) * -(-n // cfg.block_n)
        assert tiles <= gemm_triton.MAX_TILES


@pytest.mark.parametrize(
    "text", [None, "{}", '{"configs": {"1,2": "m16n16k16s1w4p3"}}', '{"configs": {"1,2,0,8": "x"}}']
)
def test_a_table_that_is_missing_or_malformed_is_refused_by_name(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "table.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match="KUBESGL_SKINNY_CONFIGS"):
        gemv_module._table_from(str(path))
