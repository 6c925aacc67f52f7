"""The mid-batch GEMM (kernels/gemm_triton.py) and its dispatch (kernels/gemv.py's `skinny_config`).

Without CUDA the kernel runs in Triton's interpreter on float32 CPU tensors (split-K's counters and its last
program's sum included); the `gpu` tests run it compiled in bf16 at Qwen3-0.6B's projection shapes, replayed in a
CUDA graph with PDL behind the kernel that writes its input, and through `linear` with a table on and off.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from kubesgl.kernels import gemm_triton
from kubesgl.kernels import gemv as gemv_module
from kubesgl.kernels.gemm_config import GemmConfig
from kubesgl.kernels.gemv import (
    SKINNY_MAX_ROWS,
    gate_up_silu,
    linear,
    qkv_linear_prep,
    rows_bucket,
    skinny_config,
)
from kubesgl.kernels.qkv_prep import QkvPrep
from support.numerics import randn, rel_err, reorder_bound, unit_roundoff

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover the kernel compiled")


def use_table(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, configs: dict[str, str]) -> None:
    """The mid-batch GEMM reads `configs` ({"n,k,op,bucket": config key}) as its table for this test."""
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"configs": configs}))
    monkeypatch.setenv("KUBESGL_SKINNY_CONFIGS", str(path))


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
@pytest.mark.parametrize(
    ("m", "n", "k", "cfg"),
    [
        (9, 24, 64, GemmConfig(16, 16, 32)),
        (33, 20, 96, GemmConfig(16, 16, 32)),
        (9, 24, 96, GemmConfig(16, 16, 32, 2)),
    ],
)
def test_skinny_gemm_silu_matches_projection_then_silu_mul(m: int, n: int, k: int, cfg: GemmConfig) -> None:
    x, w = randn(m, k, seed=m), randn(2 * n, k, seed=n, scale=k**-0.5)
    out = gemm_triton.skinny_gemm(x, w, cfg, silu=True)
    assert out.shape == (m, n)
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    # silu(g) * u moves with g by at most |u| * max|silu'| (< 1.1) and with u by |silu(g)| (< |g| + 0.3).
    assert rel_err(out, F.silu(gate) * up) < 4 * reorder_bound(torch.float32, k)


def prep_case(m: int, qk_norm: bool, seed: int = 0) -> tuple[QkvPrep, QkvPrep, int]:
    """Two QkvPrep of one batch (4 q / 2 kv heads of 16 dims, 24 cache slots) with separate zeroed caches: one for
    the fused kernel, one for the reference; and the qkv width."""
    heads, kv_heads, d, slots = 4, 2, 16, 24
    angles = torch.arange(64)[:, None] * (1e4 ** (-torch.arange(d // 2) / (d // 2)))[None, :]
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 64, (m,), generator=gen)
    loc = torch.randperm(slots, generator=gen)[:m]
    qw, kw = (
        (1 + 0.1 * randn(d, seed=seed + 1), 1 + 0.1 * randn(d, seed=seed + 2)) if qk_norm else (None, None)
    )

    def one() -> QkvPrep:
        zeros = lambda: torch.zeros(slots, kv_heads, d)  # noqa: E731
        return QkvPrep(
            positions, loc, angles.cos(), angles.sin(), qw, kw, 1e-6, zeros(), zeros(), heads, kv_heads
        )

    return one(), one(), (heads + 2 * kv_heads) * d


@cpu_interpreter
@pytest.mark.parametrize("qk_norm", [True, False], ids=["qwen3", "llama"])
@pytest.mark.parametrize("cfg", [GemmConfig(16, 8, 32), GemmConfig(16, 8, 32, 3)], ids=lambda c: c.key())
def test_qkv_prep_epilogue_matches_the_projection_and_qkv_prep(qk_norm: bool, cfg: GemmConfig) -> None:
    """PREP: q, and k and v in their cache slots (and no other slot), as `qkv_prep` leaves them after the
    projection."""
    m, k = 7, 96
    fused, ref, n = prep_case(m, qk_norm)
    x, w = randn(m, k, seed=5), randn(n, k, seed=8, scale=k**-0.5)
    q = gemm_triton.qkv_prep_gemm(x, w, cfg, fused)
    want = ref.run(F.linear(x, w))
    assert q.shape == (m, 4 * 16)
    bound = 8 * reorder_bound(torch.float32, k)  # the projection's sums, then the norm and RoPE's few ops
    assert rel_err(q, want.view(m, -1)) < bound
    assert rel_err(fused.k_cache, ref.k_cache) < bound and rel_err(fused.v_cache, ref.v_cache) < bound
    untouched = torch.ones(24, dtype=torch.bool)
    untouched[ref.out_loc] = False
    assert not fused.k_cache[untouched].any() and not fused.v_cache[untouched].any()
    assert counters_zero(x.device)


def test_qkv_prep_gemm_refuses_a_tile_that_is_not_half_a_head_and_a_width_that_is_not_the_heads() -> None:
    fused, _, n = prep_case(5, True)
    x = torch.zeros(5, 32)
    with pytest.raises(ValueError, match="block_n must be head_dim / 2 = 8"):
        gemm_triton.qkv_prep_gemm(x, torch.zeros(n, 32), GemmConfig(16, 16, 16), fused)
    with pytest.raises(ValueError, match=r"qkv width 112 is not \(4 \+ 2 \* 2\) \* 16"):
        gemm_triton.qkv_prep_gemm(x, torch.zeros(112, 32), GemmConfig(16, 8, 16), fused)
    with pytest.raises(ValueError, match="q and k norms come together"):
        gemm_triton.qkv_prep_gemm(
            x, torch.zeros(n, 32), GemmConfig(16, 8, 16), replace(fused, k_norm_weight=None)
        )


@cpu_interpreter
def test_qkv_linear_prep_declines_a_head_layout_its_config_does_not_tile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The table is keyed by (N, K, op, rows) alone, so a model of the same qkv width with other heads can hit a
    prep entry: it gets None (the decoder runs the projection and qkv_prep), not the kernel's ValueError. Fake:
    skinny_config stands in for a table lookup on CUDA (off CUDA it names nothing), returning `cfg`."""
    fused, _, n = prep_case(7, True)
    x = randn(7, 96, seed=5)
    cfg = GemmConfig(16, 16, 32)  # tiles 32-wide heads; these are 16 wide
    monkeypatch.setattr(gemv_module, "skinny_config", lambda *a, **kw: cfg)
    assert qkv_linear_prep(x, randn(n, 96, seed=8), None, lambda: fused) is None
    cfg = GemmConfig(16, 8, 32)  # half a head, but a width of 7 heads where this layer has 8
    assert qkv_linear_prep(x, randn(7 * 16, 96, seed=8), None, lambda: fused) is None
    assert qkv_linear_prep(x, randn(n, 96, seed=8), None, lambda: fused) is not None


def test_skinny_gemm_refuses_what_it_cannot_run() -> None:
    x, w = torch.zeros(8, 64), torch.zeros(32, 64)
    with pytest.raises(ValueError, match=r"x \(8, 64\) and w \(32, 48\)"):
        gemm_triton.skinny_gemm(x, torch.zeros(32, 48), GemmConfig(16, 16, 16))
    with pytest.raises(ValueError, match="even row count"):
        gemm_triton.skinny_gemm(x, torch.zeros(31, 64), GemmConfig(16, 16, 16), silu=True)
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
        json.dumps(
            {
                "configs": {
                    "4096,1024,0,64": "m64n64k128s1w4p3",  # the fifteenth session's 0 / 1 for linear / silu
                    "3072,1024,1,8": "m16n32k64s1w4p4",
                    "4096,1024,prep,16": "m16n64k128s4w4p3",
                    "3072,1024,silu,256": "m64n64k64s1w4p4",
                }
            }
        )
    )
    table = gemv_module._table_from(str(path))
    assert table == {
        (4096, 1024, "linear", 64): GemmConfig(64, 64, 128, 1, 4, 3),
        (3072, 1024, "silu", 8): GemmConfig(16, 32, 64, 1, 4, 4),
        (4096, 1024, "prep", 16): GemmConfig(16, 64, 128, 4, 4, 3),
        (3072, 1024, "silu", 256): GemmConfig(64, 64, 64, 1, 4, 4),
    }


@cpu_interpreter
def test_no_config_off_cuda_so_cpu_projections_keep_f_linear(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On CPU (and for float32, and outside 5-256 rows) `linear` stays F.linear, bit for bit, table or not, and
    neither fold runs (the decoder runs its separate kernels)."""
    use_table(monkeypatch, tmp_path, {"32,64,0,8": "m16n16k16s1w4p3", "128,32,prep,8": "m16n8k16s1w4p3"})
    x, w = randn(8, 64, seed=1), randn(32, 64, seed=2)
    assert skinny_config(x, w) is None and skinny_config(x.bfloat16(), w.bfloat16()) is None
    assert torch.equal(linear(x, w), F.linear(x, w))
    assert gate_up_silu(x, randn(64, 64, seed=3)) is None
    fused, _, n = prep_case(8, True)
    qkv = torch.zeros(n, 32, dtype=torch.bfloat16)
    assert qkv_linear_prep(randn(8, 32, seed=1).bfloat16(), qkv, None, lambda: fused) is None


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
    use_table(
        monkeypatch,
        tmp_path,
        {"1024,2048,linear,64": "m64n64k128s4w4p3", "3072,1024,silu,64": "m64n32k128s1w4p3"},
    )
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


def gpu_prep(m: int, seed: int = 0) -> QkvPrep:
    """Qwen3-0.6B's prep on the device: 16 q / 8 kv heads of 128, seeded positions, one cache slot per row."""
    gen = torch.Generator().manual_seed(seed)
    inv = 1e6 ** (-torch.arange(64, dtype=torch.float32) / 64)
    angles = (torch.arange(4096, dtype=torch.float32)[:, None] * inv[None, :]).cuda()
    slots = m + 8
    norm_w = lambda s: (1 + 0.1 * randn(128, seed=s)).to("cuda", torch.bfloat16)  # noqa: E731
    zeros = lambda: torch.zeros(slots, 8, 128, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    return QkvPrep(
        torch.randint(0, 4096, (m,), generator=gen).cuda(),
        torch.randperm(slots, generator=gen)[:m].cuda(),
        angles.cos(),
        angles.sin(),
        norm_w(seed + 1),
        norm_w(seed + 2),
        1e-6,
        zeros(),
        zeros(),
        16,
        8,
    )


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("m", [5, 16, 64, 256])
@pytest.mark.parametrize(
    "cfg",
    [GemmConfig(16, 64, 128, 4), GemmConfig(64, 64, 64, 1, 4, 4), GemmConfig(64, 64, 128, 2)],
    ids=lambda c: c.key(),
)
def test_gpu_qkv_prep_gemm_matches_cublas_and_qkv_prep(m: int, cfg: GemmConfig) -> None:
    """At Qwen3-0.6B's shapes in bf16, replayed in a CUDA graph behind the kernel that writes x: q and the cache
    slots agree with the two kernels it replaces, to a bf16 step (the projection's sums in another order can put
    a value across a rounding boundary, which the norm and RoPE carry)."""
    fused, ref = gpu_prep(m), gpu_prep(m)
    src = randn(m, 1024, seed=m).to("cuda", torch.bfloat16)
    w = randn(4096, 1024, seed=4, scale=1024**-0.5).to("cuda", torch.bfloat16)
    x = torch.empty_like(src)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.mul(src, 1, out=x)
        gemm_triton.qkv_prep_gemm(x, w, cfg, fused)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 2, out=x)
        q = gemm_triton.qkv_prep_gemm(x, w, cfg, fused)
    graph.replay()
    torch.cuda.synchronize()
    want = ref.run(F.linear(2 * src, w)).view(m, -1)
    bound = 4 * unit_roundoff(torch.bfloat16)
    assert rel_err(q, want) < bound
    assert rel_err(fused.k_cache, ref.k_cache) < bound and rel_err(fused.v_cache, ref.v_cache) < bound
    assert counters_zero(x.device)


def test_the_built_in_table_names_configs_the_kernel_can_launch() -> None:
    """Every entry parses and names an op, a qkv-prep one tiles half a head, and split-K's output tiles fit the
    counters."""
    table = gemv_module._table_from(None)
    assert len(table) == len(gemv_module.SKINNY_TABLE) > 0
    for (n, k, op, bucket), cfg in table.items():
        assert bucket == rows_bucket(bucket) and 8 <= bucket <= SKINNY_MAX_ROWS
        assert op in gemv_module.SKINNY_OPS
        assert op != "prep" or cfg.block_n == 64  # Qwen3's head_dim / 2
        assert k // cfg.split_k >= cfg.block_k, (n, k, cfg)
        tiles = -(-bucket // cfg.block_m) * -(-n // cfg.block_n)
        assert tiles <= gemm_triton.MAX_TILES


@pytest.mark.parametrize(
    "text",
    [
        None,
        "{}",
        '{"configs": {"1,2": "m16n16k16s1w4p3"}}',
        '{"configs": {"1,2,0,8": "x"}}',
        '{"configs": {"1,2,gelu,8": "m16n16k16s1w4p3"}}',
    ],
)
def test_a_table_that_is_missing_or_malformed_is_refused_by_name(tmp_path: Path, text: str | None) -> None:
    path = tmp_path / "table.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ValueError, match="KUBESGL_SKINNY_CONFIGS"):
        gemv_module._table_from(str(path))
