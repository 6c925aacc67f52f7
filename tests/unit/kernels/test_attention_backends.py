"""Every attention backend against the float32 torch reference on random paged KV.

On a CUDA machine the backends run in bf16 at Qwen3 head size (`gpu` marker). Without CUDA, the Triton
kernels run on CPU tensors in Triton's interpreter (tests/conftest.py turns it on), in float32 and at
tiny sizes: Triton's interpreter multiplies bf16 tiles wrongly, so bf16 is only checked on the GPU.
"""

from __future__ import annotations

import importlib.util
import random
from typing import NamedTuple

import pytest
import torch
from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.decode_plan import DecodeWork, plan_decode_work, target_items, work_capacity
from kubesgl.attention.errors import BackendUnavailableError
from kubesgl.attention.graph_hooks import supports_cuda_graph
from kubesgl.attention.hybrid_backend import HybridAttention
from kubesgl.attention.registry import create_backend
from kubesgl.attention.torch_backend import TorchAttention
from kubesgl.kv.kv_cache import KVCache
from support.numerics import reorder_bound, unit_roundoff

CUDA = torch.cuda.is_available()
cpu_interpreter = pytest.mark.skipif(CUDA, reason="the GPU tests cover these kernels compiled")
HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
LAYER = 1


class Shape(NamedTuple):
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: str
    tol: float  # bound on ||out - ref|| / ||ref||


CPU_CONTEXT = 256  # the longest sequence a CPU case attends (prefix + extend)


def cpu_tol(head_dim: int) -> float:
    """float32 against float32 torch in another order: the q.k sum, the softmax sum and the P.V sum."""
    return reorder_bound(torch.float32, head_dim + 2 * CPU_CONTEXT)


# bf16 against a float32 reference: the scores' inputs, P and the output are each rounded to bf16 (3 roundings).
GPU_TOL = 3 * unit_roundoff(torch.bfloat16)
CPU_SHAPES = [
    Shape(4, 2, 32, torch.float32, "cpu", cpu_tol(32)),
    Shape(8, 1, 16, torch.float32, "cpu", cpu_tol(16)),
]
GPU_SHAPES = [
    Shape(16, 8, 128, torch.bfloat16, "cuda", GPU_TOL),
    Shape(32, 4, 128, torch.bfloat16, "cuda", GPU_TOL),
]


class Lens(NamedTuple):
    """Ragged lengths: prefixes not page-aligned, extends longer than one 64-row tile."""

    mode: str
    prefix_lens: list[int]
    extend_lens: list[int]


DECODE = Lens("decode", [0, 16, 39, 129], [1, 1, 1, 1])
EXTEND = Lens("extend", [0, 3, 16, 50], [70, 1, 20, 9])
GPU_DECODE = Lens("decode", [0, 15, 511, 1000, 77, 2047, 300, 8], [1] * 8)
GPU_EXTEND = Lens("extend", [0, 100, 16, 700, 0], [300, 1, 129, 64, 5])
# A mixed step (--enable-mixed-chunk): prefill chunks, then the decode batch as one-token extend rows.
MIXED = Lens("extend", [0, 5, 16, 39, 129, 2], [70, 20, 1, 1, 1, 1])
GPU_MIXED = Lens(
    "extend",
    [0, 700] + [random.Random(5).randrange(1, 2048) for _ in range(40)],
    [300, 129] + [1] * 40,
)


class Batch(NamedTuple):
    meta: AttentionMetadata
    kv: KVCache
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out_loc: torch.Tensor


def new_cache(shape: Shape, page_size: int, num_pages: int, gen: torch.Generator) -> KVCache:
    kv = KVCache(2, num_pages, page_size, shape.kv_heads, shape.head_dim, shape.dtype, shape.device)
    for layer in range(2):
        kv.k_pages(layer).copy_(torch.randn(kv.k_pages(layer).shape, generator=gen))
        kv.v_pages(layer).copy_(torch.randn(kv.v_pages(layer).shape, generator=gen))
    return kv


def random_batch(shape: Shape, page_size: int, lens: Lens, seed: int, kv: KVCache | None = None) -> Batch:
    """Random KV everywhere (in `kv` if given), pages in random order (page 0 stays scratch)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(lens.prefix_lens, lens.extend_lens, strict=True)]
    pages = [-(-n // page_size) for n in seq_lens]
    kv = kv or new_cache(shape, page_size, sum(pages) + 5, gen)
    order = (torch.randperm(kv.num_pages - 1, generator=gen) + 1).tolist()
    table = torch.full((len(seq_lens), max(pages) + 3), -1, dtype=torch.int32)  # -1 past a request's pages
    slots = []
    for i, n in enumerate(pages):
        table[i, :n] = torch.tensor(order[sum(pages[:i]) : sum(pages[: i + 1])])
        new_positions = range(lens.prefix_lens[i], seq_lens[i])
        slots += [int(table[i, j // page_size]) * page_size + j % page_size for j in new_positions]

    def rand(heads: int) -> torch.Tensor:
        return (
            torch.randn((len(slots), heads, shape.head_dim), generator=gen).to(shape.dtype).to(shape.device)
        )

    meta = AttentionMetadata(
        mode=lens.mode,
        page_size=page_size,
        seq_lens=seq_lens,
        extend_lens=lens.extend_lens,
        prefix_lens=lens.prefix_lens,
        page_table=table.to(shape.device),
        seq_lens_dev=torch.tensor(seq_lens, dtype=torch.int32, device=shape.device),
    )
    out_loc = torch.tensor(slots, device=shape.device)
    return Batch(meta, kv, rand(shape.q_heads), rand(shape.kv_heads), rand(shape.kv_heads), out_loc)


def reference(batch: Batch, scale: float) -> torch.Tensor:
    """The torch backend in float32 over a float32 copy of the cache."""
    kv = batch.kv
    kv32 = KVCache(2, kv.num_pages, kv.page_size, kv.num_kv_heads, kv.head_dim, torch.float32, kv.device)
    for layer in range(2):
        kv32.k_pages(layer).copy_(kv.k_pages(layer))
        kv32.v_pages(layer).copy_(kv.v_pages(layer))
    ref = TorchAttention()
    ref.plan(batch.meta)
    kv32.store(LAYER, batch.out_loc, batch.k.float(), batch.v.float())
    return ref.forward(batch.q.float(), LAYER, kv32, scale)


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    assert out.shape == ref.shape
    assert torch.isfinite(out).all()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e} >= {tol:.2e}"


def make(name: str, shape: Shape, page_size: int) -> object:
    return create_backend(
        name,
        device=shape.device,
        page_size=page_size,
        num_q_heads=shape.q_heads,
        num_kv_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        dtype=shape.dtype,
    )


def run_backend(backend: object, batch: Batch, scale: float) -> torch.Tensor:
    backend.plan(batch.meta)
    batch.kv.store(LAYER, batch.out_loc, batch.k, batch.v)  # the layer writes the batch's K/V first
    return backend.forward(batch.q, LAYER, batch.kv, scale)


def check_backend(name: str, shape: Shape, page_size: int, lens: Lens, seed: int) -> None:
    batch = random_batch(shape, page_size, lens, seed=seed)
    scale = shape.head_dim**-0.5
    out = run_backend(make(name, shape, page_size), batch, scale)
    assert_close_to_reference(out, reference(batch, scale), shape.tol)


# --- CPU: Triton kernels in the interpreter ---------------------------------------------------------


@cpu_interpreter
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=["gqa2", "gqa8"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("lens", [DECODE, EXTEND, MIXED], ids=["decode", "extend_with_prefix", "mixed"])
def test_triton_matches_torch_in_interpreter(shape: Shape, page_size: int, lens: Lens) -> None:
    check_backend("triton", shape, page_size, lens, seed=page_size)


@cpu_interpreter
@pytest.mark.parametrize(("splits", "min_chunk"), [(2, 0), (3, 0), (16, 0), (4, 64), (4, 128)])
def test_triton_split_kv_decode_merges_slices(splits: int, min_chunk: int) -> None:
    """More slices than 64-token blocks leaves some slices empty; they must weigh nothing in the merge. With a
    shortest slice (`min_chunk`) short requests stay whole and only the 130-token one is cut. Empty slices
    write no output: the partial buffer starts as NaN, so reading one would show."""
    from kubesgl.attention.triton_kernels import decode_attention

    shape = CPU_SHAPES[0]
    batch = random_batch(shape, 16, DECODE, seed=splits)
    batch.kv.store(LAYER, batch.out_loc, batch.k, batch.v)
    b, h, d = batch.q.shape
    out = torch.full_like(batch.q, float("nan"))
    partial_out = torch.full((b, h, splits, d), float("nan"))
    partial_lse = torch.full((b, h, splits), float("nan"))
    decode_attention(
        batch.q,
        batch.kv.k_pages(LAYER),
        batch.kv.v_pages(LAYER),
        batch.meta.page_table,
        batch.meta.seq_lens_dev,
        out,
        d**-0.5,
        partial_out,
        partial_lse,
        min_chunk=min_chunk,
    )
    assert_close_to_reference(out, reference(batch, d**-0.5), shape.tol)


def check_plan_covers_each_request_once(seq_lens: list[int], target: int, block_n: int) -> DecodeWork:
    work = plan_decode_work(seq_lens, target, block_n)
    assert work.capacity == work_capacity(len(seq_lens), target) >= work.num_items
    ints = work.ints.tolist()
    items = [tuple(ints[4 * i : 4 * i + 4]) for i in range(work.capacity)]
    real, slack = items[: work.num_items], items[work.num_items :]
    assert all(it == (-1, 0, 0, -1) for it in slack)
    lengths = [end - start for _, start, end, _ in real]
    assert lengths == sorted(lengths, reverse=True) and min(lengths) >= 1
    chunk = -(-max(1, -(-sum(seq_lens) // target)) // block_n) * block_n
    assert max(lengths) <= max(chunk, 1)
    merge = ints[4 * work.capacity :]
    slots_seen: list[int] = []
    for b, n in enumerate(seq_lens):
        mine = sorted((start, end, slot) for r, start, end, slot in real if r == b)
        assert [s for s, _, _ in mine] == [0] + [e for _, e, _ in mine[:-1]] and mine[-1][1] == n
        assert all(s % block_n == 0 for s, _, _ in mine)  # parts start on whole blocks
        first, count = merge[2 * b : 2 * b + 2]
        if len(mine) == 1:
            assert mine[0][2] == -1 and count == 0  # whole: written directly, no merge
        else:
            assert [slot for _, _, slot in mine] == list(range(first, first + count))
            assert count == len(mine)
            slots_seen += range(first, first + count)
    assert sorted(slots_seen) == list(range(work.num_partials))
    return work


def test_decode_plan_cuts_long_requests_into_near_equal_block_parts_longest_first() -> None:
    rng = random.Random(0)
    for batch, target in [(1, 1), (1, 33), (5, 4), (40, 7), (256, 132), (256, 528), (3, 1000)]:
        seq_lens = [rng.choice([1, 15, 16, 17, 64, 65, rng.randint(1, 3000)]) for _ in range(batch)]
        check_plan_covers_each_request_once(seq_lens, target, block_n=64)
    work = check_plan_covers_each_request_once([1, 130, 64, 65, 300], 4, 64)
    assert work.num_items == 6 and work.longest == 192  # 560 tokens / 4 -> 192-token chunk: 300 = 192 + 108
    equal = plan_decode_work([850] * 256, target_items(132, 8, 8.0), 64)
    assert equal.num_partials == 0 and equal.num_items == 256  # a full batch of equal lengths is not cut


def test_decode_plan_rejects_empty_requests() -> None:
    with pytest.raises(ValueError, match="at least one token"):
        plan_decode_work([3, 0], 4, 64)
    with pytest.raises(ValueError, match="at least one request"):
        plan_decode_work([], 4, 64)


PLANNED_LENS = Lens(
    "decode", [0, 14, 15, 16, 63, 64, 200, 129], [1] * 8
)  # lengths 1, 15..17, 64, 65, 201, 130


@cpu_interpreter
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("waves", [1.0, 16.0], ids=["whole", "cut"])
def test_triton_planned_decode_matches_torch_on_ragged_lengths(
    page_size: int, head_dim: int, waves: float
) -> None:
    """GQA 16 q / 8 kv heads: with few target items every request stays whole (outputs written directly); with
    many, the long ones are cut at block boundaries that fall inside pages and are merged by their LSE."""
    from kubesgl.attention.triton_backend import TritonAttention

    shape = Shape(16, 8, head_dim, torch.float32, "cpu", cpu_tol(head_dim))
    backend = TritonAttention(
        device="cpu",
        num_q_heads=16,
        num_kv_heads=8,
        head_dim=head_dim,
        decode_schedule="planned",
        plan_waves=waves,
    )
    batch = random_batch(shape, page_size, PLANNED_LENS, seed=page_size + head_dim)
    out = run_backend(backend, batch, head_dim**-0.5)
    assert (backend._plan.partial_out.shape[0] > 1) == (waves > 1)
    assert_close_to_reference(out, reference(batch, head_dim**-0.5), shape.tol)


@cpu_interpreter
@pytest.mark.parametrize("name", ["triton-split", "triton-planned"])
def test_triton_graph_replay_pads_batch_into_scratch_page(name: str) -> None:
    """plan_replay copies a 3-request batch into graph buffers of 5; padded rows read the scratch page."""
    shape, page_size = CPU_SHAPES[0], 16
    backend = make(name, shape, page_size)
    assert supports_cuda_graph(backend)
    backend.init_cuda_graph(max_bs=8, max_pages=32)
    backend.plan_capture(5)
    for seed in (1, 2):  # a second replay with other lengths must not see the first one's table
        batch = random_batch(
            shape, page_size, Lens("decode", [7 * seed, 40 + seed, 100 - seed], [1] * 3), seed
        )
        backend.plan_replay(batch.meta, 5)
        pad = torch.zeros((2, *batch.q.shape[1:]))
        q, k, v = (torch.cat([x, pad[:, : x.shape[1]]]) for x in (batch.q, batch.k, batch.v))
        out_loc = torch.cat([batch.out_loc, torch.zeros(2, dtype=batch.out_loc.dtype)])
        batch.kv.store(LAYER, out_loc, k, v)
        out = backend.forward(q, LAYER, batch.kv, shape.head_dim**-0.5)
        assert torch.isfinite(out).all()
        assert_close_to_reference(out[:3], reference(batch, shape.head_dim**-0.5), shape.tol)


@cpu_interpreter
def test_hybrid_routes_extend_and_decode_to_their_backends() -> None:
    shape = CPU_SHAPES[0]
    backend = make("torch,triton", shape, 16)
    assert isinstance(backend, HybridAttention) and backend.name == "torch,triton"
    assert supports_cuda_graph(backend)
    for lens in (EXTEND, DECODE, MIXED):  # a mixed step is one extend batch for the prefill backend
        batch = random_batch(shape, 16, lens, seed=3)
        out = run_backend(backend, batch, shape.head_dim**-0.5)
        assert backend._active is (backend.decode_backend if lens is DECODE else backend.extend_backend)
        assert_close_to_reference(out, reference(batch, shape.head_dim**-0.5), shape.tol)


def test_extend_tiles_list_each_block_once_costliest_first() -> None:
    from kubesgl.attention.triton_kernels import extend_tiles

    tiles = extend_tiles([0, 300, 5, 900], [130, 1, 64, 1], block_m=64)  # 3 + 1 + 1 + 1 blocks
    pairs = list(zip(*tiles.tolist(), strict=True))
    assert sorted(pairs) == [(0, 0), (0, 1), (0, 2), (1, 0), (2, 0), (3, 0)]
    assert pairs[:3] == [(3, 0), (1, 0), (0, 2)]  # keys seen: 901, 301, 130, then 128, 69, 64
    assert extend_tiles([7], [1]).tolist() == [[0], [0]]


# --- registry ---------------------------------------------------------------------------------------


def test_unknown_backend_name_is_a_clear_error() -> None:
    with pytest.raises(
        ValueError, match="unknown attention backend 'flashattn'.*torch, triton, flashinfer, fa3"
    ):
        make("flashattn", CPU_SHAPES[0], 1)
    with pytest.raises(ValueError, match="prefill,decode"):
        make("triton,torch,torch", CPU_SHAPES[0], 1)


def test_auto_is_torch_on_cpu() -> None:
    assert isinstance(make("auto", CPU_SHAPES[0], 1), TorchAttention)
    assert not supports_cuda_graph(make("auto", CPU_SHAPES[0], 1))


def test_auto_may_resolve_to_a_hybrid(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA `auto` is 'flashinfer,triton': the resolved name goes through the 'prefill,decode' parse (a
    hybrid resolved after that parse was refused as unknown on the H200). Here the resolver names the one
    pair that builds on a CPU, which the parse folds into one backend."""
    from kubesgl.attention import registry

    monkeypatch.setattr(registry, "resolve_auto", lambda device, dtype: "torch, torch")
    assert isinstance(make("auto", CPU_SHAPES[0], 1), TorchAttention)


def test_auto_leaves_flashinfer_out_for_a_float32_model() -> None:
    """FlashInfer has no float32 kernels (its JIT failed with a KeyError on the H200 for a float32 test model):
    `auto` picks Triton for both phases there, and naming FlashInfer for float32 is refused with what to do."""
    from kubesgl.attention import registry

    cuda = torch.device("cuda")  # only resolved to a name: no device is touched
    assert registry.resolve_auto(cuda, torch.float32) == "triton"
    assert registry.resolve_auto(cuda, torch.bfloat16) in ("flashinfer,triton", "triton")
    assert registry.resolve_auto(torch.device("cpu"), torch.bfloat16) == "torch"
    with pytest.raises(BackendUnavailableError, match="needs a float16 or bfloat16 model, got torch.float32"):
        registry.create_backend("flashinfer", device="cpu", page_size=1, num_q_heads=4, num_kv_heads=2,
                                head_dim=16, dtype=torch.float32)  # fmt: skip


@pytest.mark.parametrize("name", ["flashinfer", "fa3"])
def test_gpu_only_backend_on_cpu_says_what_is_missing(name: str) -> None:
    with pytest.raises(BackendUnavailableError, match=f"attention backend '{name}' needs"):
        make(name, CPU_SHAPES[0], 1)


# --- GPU: compiled kernels and FlashInfer in bf16 ---------------------------------------------------

GPU_BACKENDS = [
    "triton-split",
    "triton-planned",
    pytest.param("flashinfer", marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")),
]


@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=["qwen3_0.6b", "gqa8"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize(
    "lens", [GPU_DECODE, GPU_EXTEND, GPU_MIXED], ids=["decode", "extend_with_prefix", "mixed"]
)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_backend_matches_torch_on_gpu(name: str, shape: Shape, page_size: int, lens: Lens) -> None:
    check_backend(name, shape, page_size, lens, seed=page_size)


@pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_default_hybrid_attends_a_mixed_step_with_flashinfer_prefill(page_size: int) -> None:
    """`auto` on the GPU (FlashInfer prefill, Triton decode): a mixed step's decode rows go to FlashInfer's
    prefill wrapper as one-token queries of one ragged extend batch."""
    shape = GPU_SHAPES[0]
    backend = make("flashinfer,triton", shape, page_size)
    batch = random_batch(shape, page_size, GPU_MIXED, seed=page_size)
    out = run_backend(backend, batch, shape.head_dim**-0.5)
    assert backend._active is backend.extend_backend
    assert_close_to_reference(out, reference(batch, shape.head_dim**-0.5), shape.tol)


@pytest.mark.parametrize("name", GPU_BACKENDS)
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_decode_graph_replays_new_batches(name: str) -> None:
    """Capture decode at batch size 6 once, then replay it for two batches of 4 with other lengths."""
    shape, page_size, bs = GPU_SHAPES[0], 16, 6
    scale = shape.head_dim**-0.5
    backend = make(name, shape, page_size)
    backend.init_cuda_graph(max_bs=8, max_pages=256)
    kv = new_cache(shape, page_size, 1024, torch.Generator().manual_seed(0))
    static = {
        "q": torch.zeros((bs, shape.q_heads, shape.head_dim), dtype=shape.dtype, device="cuda"),
        "k": torch.zeros((bs, shape.kv_heads, shape.head_dim), dtype=shape.dtype, device="cuda"),
        "v": torch.zeros((bs, shape.kv_heads, shape.head_dim), dtype=shape.dtype, device="cuda"),
        "out_loc": torch.zeros(bs, dtype=torch.int64, device="cuda"),
    }

    def run() -> torch.Tensor:
        kv.store(LAYER, static["out_loc"], static["k"], static["v"])
        return backend.forward(static["q"], LAYER, kv, scale)

    backend.plan_capture(bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm-up outside the graph compiles the kernels
        run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_out = run()

    for seed, prefix in ((11, [5, 900, 33, 2000]), (12, [1500, 2, 64, 700])):
        batch = random_batch(shape, page_size, Lens("decode", prefix, [1] * 4), seed, kv=kv)
        backend.plan_replay(batch.meta, bs)
        for key in static:
            static[key].zero_()  # padded rows: zero inputs, writing the scratch slot 0
            static[key][:4].copy_(getattr(batch, key))
        graph.replay()
        torch.cuda.synchronize()
        assert_close_to_reference(graph_out[:4].clone(), reference(batch, scale), shape.tol)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("batch", [96, 256])
def test_planned_decode_on_a_large_ragged_batch_matches_torch(batch: int) -> None:
    """Workload-like lengths (100-1600): at 96 requests the long ones are cut, at 256 all stay whole."""
    rng = random.Random(batch)
    prefix = [rng.randint(99, 1599) for _ in range(batch)]
    check_backend("triton-planned", GPU_SHAPES[0], 16, Lens("decode", prefix, [1] * batch), seed=batch)


def test_flatten_page_table_concatenates_each_requests_pages() -> None:
    from kubesgl.attention.flashinfer_backend import flatten_page_table

    table = torch.tensor([[5, 6, 7, -1], [9, -1, -1, -1], [1, 2, 3, 4]], dtype=torch.int32)
    assert flatten_page_table(table, [2, 1, 4]).tolist() == [5, 6, 9, 1, 2, 3, 4]
    assert flatten_page_table(table, [3, 0, 1]).tolist() == [5, 6, 7, 1]


def test_decode_splits_cut_every_request_in_small_batches_and_only_long_ones_in_large() -> None:
    from kubesgl.attention.triton_backend import LONG_SLICE, LONG_SPLITS, MAX_DECODE_SPLITS, decode_splits

    assert decode_splits(1, 8, 132) == (MAX_DECODE_SPLITS, 0)
    assert decode_splits(16, 8, 132) == (3, 0)
    assert decode_splits(256, 8, 132) == (LONG_SPLITS, LONG_SLICE)
