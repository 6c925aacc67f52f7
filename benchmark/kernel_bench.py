"""Kernel microbenchmarks for the decode levers on Qwen3-0.6B shapes: what a step's small projections cost, and
the planned Triton decode attention vs the split one and FlashInfer. Prints one summary table last.

    python benchmark/kernel_bench.py --part copy|latency|attn|pdl|mlp|gemv --json $OUT/kb.jsonl   # one part a process
    python benchmark/kernel_bench.py --summary $OUT/kb.jsonl                       # the table, from the rows

copy: device-to-device copy bandwidth (read + write), the ceiling the other rows are read against.
latency: what a decode step's small kernels cost beyond their bytes. A chain of 1,000 one-element kernels in a
  graph (the per-kernel boundary: drain, launch, ramp); each projection at M 1-256 with its weight cold (rotating
  copies > 200 MB) and hot (one weight, L2-resident), under cuBLAS and cuBLASLt
  (torch.backends.cuda.preferred_blas_library); a decoder layer's projections over 8 layers under both.
pdl: programmatic dependent launch (kernels/pdl.py) off and on in the same process: a graph of 1,000 chained
  RMSNorm kernels on one 1,024-wide row (the boundary between two of our Triton kernels), and a decoder layer's
  projections with their norm/SiLU kernels over 8 layers (cuBLAS -> Triton boundaries) at M 1-256.
mlp: the decode MLP at M 1-16 over 8 layers in a graph: gate_up GEMM, SiLU·mul, down GEMM (cuBLAS + our kernel)
  against the one-kernel fused MLP (kernels/fused_mlp.py; "fused/32": 32-wide intermediate slices instead of 16),
  with its error against a float32 reference.
attn: decode attention at 16 q / 8 kv heads, head_dim 128, page 16, bf16 on bs 256 with workload-like ragged
  lengths (prompt 100-1024 + generated 0-1024, seeded), bs 256 x 850, bs 64 and 16 ragged; each backend
  through its CUDA-graph hooks (benchmark/attention_bw.py's harness, 10 layer calls per graph); planned
  schedule at several work-list sizes (waves per multiprocessor).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SHAPES = {
    "qkv": (4096, 1024),
    "o": (1024, 2048),
    "gate_up": (6144, 1024),
    "down": (1024, 3072),
    "lm_head": (151936, 1024),
}
ROWS = [1, 8, 32, 64, 128, 256]
BF16 = torch.bfloat16
EPS = 1e-6
PLAN_WAVES = [4.0, 8.0, 16.0, 32.0]


def seeded_rand(dtype: torch.dtype = BF16, seed: int = 0) -> Callable[..., torch.Tensor]:
    """rand(*shape, scale=1.0): randn * scale in `dtype` on the device, drawn from one seeded generator, so a part
    draws the same values run to run."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(dtype)

    return rand


def layer_weights(rand: Callable[..., torch.Tensor], layers: int = 8) -> list[dict[str, torch.Tensor]]:
    """`layers` decoder layers' projection weights (qkv, o, gate_up, down; 8 are more than L2 holds), each
    scaled by 1/sqrt(K)."""
    names = ("qkv", "o", "gate_up", "down")
    return [
        {name: rand(*SHAPES[name], scale=SHAPES[name][1] ** -0.5) for name in names} for _ in range(layers)
    ]


def emit(row: dict[str, Any], path: str | None) -> None:
    print(
        "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
    )
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def graph_seconds(fn: Callable[[], object], calls: int, reps: int = 30) -> float:
    """Seconds per call of `fn` (which makes `calls` calls) captured in a CUDA graph: median of replays."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return replay_seconds(graph, reps) / calls


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int = 30) -> float:
    """Median seconds of `reps` replays of a captured graph (after one untimed replay), by CUDA events."""
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# --- copy ---------------------------------------------------------------------------------------------


def part_copy(path: str | None) -> None:
    from attention_bw import copy_bandwidth

    emit({"part": "copy", "device": torch.cuda.get_device_name(), "TBps": copy_bandwidth()}, path)


def layer_step(
    w: dict[str, torch.Tensor],
    h: torch.Tensor,
    r: torch.Tensor,
    attn_out: torch.Tensor,
    nw: torch.Tensor,
    lin: Callable[..., torch.Tensor] = F.linear,
    *,
    fold_silu: bool = False,
    attend: Callable[[], object] | None = None,
    prep: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer's projections and norms as the engine runs them: (hidden, residual) after it. `lin` is the
    projection (cuBLAS by default); `fold_silu` takes the engine's folds around gate_up where they apply (the
    residual norm and SiLU·mul in the GEMV's one kernel: kernels.gemv.norm_linear, else gate_up_silu); `prep`, a
    kernels.qkv_prep.QkvPrep, adds the q/k norm, RoPE and KV store after qkv (kernels.gemv.qkv_linear_prep's one
    kernel where its table has it, else `lin` and qkv_prep); `attend`, if given, runs between qkv and o, and
    `attn_out` stands in for its output."""
    from kubesgl.kernels.activation import silu_and_mul
    from kubesgl.kernels.gemv import gate_up_silu, norm_linear, qkv_linear_prep
    from kubesgl.kernels.norm import fused_add_rms_norm

    normed, r = fused_add_rms_norm(h, r, nw, EPS)
    q = qkv_linear_prep(normed, w["qkv"], None, lambda: prep) if prep is not None else None
    if q is None:
        qkv = lin(normed, w["qkv"])
        if prep is not None:
            prep.run(qkv)
    if attend is not None:
        attend()
    o = lin(attn_out, w["o"])
    mlp_in = norm_linear(o, r, nw, EPS, w["gate_up"], silu=True) if fold_silu else None
    if mlp_in is not None:
        act, r = mlp_in
    else:
        normed, r = fused_add_rms_norm(o, r, nw, EPS)
        act = gate_up_silu(normed, w["gate_up"]) if fold_silu else None
        if act is None:
            act = silu_and_mul(lin(normed, w["gate_up"]))
    return lin(act, w["down"]), r


def qkv_prep_args(m: int, q_heads: int = 16, kv_heads: int = 8, head_dim: int = 128, seed: int = 0) -> Any:
    """A kernels.qkv_prep.QkvPrep for `m` decode rows on the device: seeded positions below 4,096, one cache
    slot each, Qwen3's RoPE base and q/k norm weights near 1."""
    from kubesgl.kernels.qkv_prep import QkvPrep

    gen = torch.Generator(device="cuda").manual_seed(seed)
    half = head_dim // 2
    inv = 1e6 ** (-torch.arange(half, device="cuda", dtype=torch.float32) / half)
    angles = torch.arange(4096, device="cuda", dtype=torch.float32)[:, None] * inv[None, :]
    slots = max(m, 16)
    norm_w = lambda: (1 + 0.1 * torch.randn(head_dim, generator=gen, device="cuda")).to(BF16)  # noqa: E731
    return QkvPrep(
        torch.randint(0, 4096, (m,), generator=gen, device="cuda"),
        torch.randperm(slots, generator=gen, device="cuda")[:m],
        angles.cos(),
        angles.sin(),
        norm_w(),
        norm_w(),
        1e-6,
        torch.zeros(slots, kv_heads, head_dim, dtype=BF16, device="cuda"),
        torch.zeros(slots, kv_heads, head_dim, dtype=BF16, device="cuda"),
        q_heads,
        kv_heads,
    )


def layer_projections(
    ws: list[dict[str, torch.Tensor]],
    nw: torch.Tensor,
    h0: torch.Tensor,
    r0: torch.Tensor,
    attn_out: torch.Tensor,
    lin: Callable[..., torch.Tensor] = F.linear,
    *,
    fold_silu: bool = False,
    prep: Any = None,
) -> Callable[[], torch.Tensor]:
    """The projections of len(ws) decoder layers (`layer_step` each; attention left out: `attn_out` stands in
    for its output)."""

    def run() -> torch.Tensor:
        h, r = h0, r0
        for w in ws:
            h, r = layer_step(w, h, r, attn_out, nw, lin, fold_silu=fold_silu, prep=prep)
        return h

    return run


# --- latency ------------------------------------------------------------------------------------------


def part_latency(path: str | None) -> None:
    rand = seeded_rand()

    tiny = torch.zeros(1, device="cuda")
    chain = 1000
    sec = graph_seconds(lambda: [tiny.add_(1.0) for _ in range(chain)], chain)
    emit({"part": "latency", "what": "kernel_boundary", "us": sec * 1e6}, path)
    libraries = ("cublas", "cublaslt")
    for name, (n, k) in SHAPES.items():
        copies = max(1, math.ceil(200e6 / (n * k * 2)))
        weights = [rand(n, k, scale=k**-0.5) for _ in range(copies)]
        for m in ROWS:
            x = rand(m, k)
            ref = F.linear(x, weights[0])
            for lib in libraries:
                torch.backends.cuda.preferred_blas_library(lib)
                err = rel_err(F.linear(x, weights[0]), ref)
                cold = graph_seconds(lambda x=x, ws=weights: [F.linear(x, w) for w in ws], len(weights))
                row = {"part": "latency", "what": "gemm", "shape": name, "m": m, "blas": lib, "cold_us": cold * 1e6,
                       "cold_TBps": n * k * 2 / cold / 1e12, "rel_err": err, "ok": err < 1e-2}  # fmt: skip
                if n * k * 2 < 20e6:  # fits the 50 MB L2 with room: the same weight, 16 calls
                    hot = graph_seconds(lambda x=x, w=weights[0]: [F.linear(x, w) for _ in range(16)], 16)
                    row |= {"hot_us": hot * 1e6, "hot_TBps": n * k * 2 / hot / 1e12}
                emit(row, path)
        weights.clear()
        torch.cuda.empty_cache()
    ws = layer_weights(rand)
    nw = 1 + 0.1 * rand(1024)
    for m in ROWS:
        projections = layer_projections(ws, nw, rand(m, 1024), rand(m, 1024), rand(m, 2048))
        for lib in libraries:
            torch.backends.cuda.preferred_blas_library(lib)
            emit(
                {
                    "part": "latency",
                    "what": "layer",
                    "m": m,
                    "blas": lib,
                    "us": graph_seconds(projections, 8) * 1e6,
                },
                path,
            )
    torch.backends.cuda.preferred_blas_library("cublas")


# --- programmatic dependent launch -------------------------------------------------------------------


def part_pdl(path: str | None) -> None:
    from kubesgl.kernels.norm import rms_norm
    from kubesgl.kernels.pdl import pdl_enabled

    rand = seeded_rand()

    nw = 1 + 0.1 * rand(1024)
    row = rand(1, 1024)
    chain = 1000

    def norms() -> torch.Tensor:
        x = row
        for _ in range(chain):
            x = rms_norm(x, nw, EPS)
        return x

    ws = layer_weights(rand)
    layers = {m: layer_projections(ws, nw, rand(m, 1024), rand(m, 1024), rand(m, 2048)) for m in ROWS}
    for pdl in (False, True):
        # kernels/pdl.py reads the switch at every launch, so one process measures both.
        os.environ["KUBESGL_DISABLE_PDL"] = "0" if pdl else "1"
        on = pdl_enabled(row)
        emit(
            {"part": "pdl", "what": "triton_chain", "pdl": on, "us": graph_seconds(norms, chain) * 1e6}, path
        )
        for m, projections in layers.items():
            emit(
                {
                    "part": "pdl",
                    "what": "layer",
                    "m": m,
                    "pdl": on,
                    "us": graph_seconds(projections, 8) * 1e6,
                },
                path,
            )
    os.environ.pop("KUBESGL_DISABLE_PDL")


# --- fused decode MLP -------------------------------------------------------------------------------


def part_mlp(path: str | None) -> None:
    from kubesgl.kernels.activation import silu_and_mul
    from kubesgl.kernels.fused_mlp import FUSED_MLP_MAX_ROWS, fused_mlp_torch
    from kubesgl.kernels.fused_mlp_triton import fused_mlp

    rand = seeded_rand()

    ws = [
        (rand(*SHAPES["gate_up"], scale=1024**-0.5), rand(*SHAPES["down"], scale=3072**-0.5))
        for _ in range(8)
    ]
    weight_bytes = sum(a.numel() + b.numel() for a, b in ws) * 2 / len(ws)

    def unfused(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return F.linear(silu_and_mul(F.linear(x, w13)), w2)

    for m in (1, 4, 8, FUSED_MLP_MAX_ROWS):
        x = rand(m, 1024)
        ref = fused_mlp_torch(x.float(), ws[0][0].float(), ws[0][1].float())
        impls = [("unfused", unfused)] + [
            (f"fused/{bi}" if bi != 16 else "fused", functools.partial(fused_mlp, block_i=bi))
            for bi in (16, 32)
        ]
        for impl, one in impls:
            err = rel_err(one(x, *ws[0]), ref)
            sec = graph_seconds(lambda x=x, one=one: [one(x, a, b) for a, b in ws], len(ws))
            row = {"part": "mlp", "m": m, "impl": impl, "us": sec * 1e6, "TBps": weight_bytes / sec / 1e12,
                   "rel_err": err, "ok": err < 2e-2}  # fmt: skip
            emit(row, path)


# --- small-batch projections (kernels/gemv.py) --------------------------------------------------------


def part_gemv(path: str | None) -> None:
    """Each Qwen3-0.6B projection at M 1-4, cuBLAS against the Triton GEMV (8 layers' weights in turn, more
    than L2 holds), then a layer's projections and norms with KUBESGL_GEMV off and on."""
    from kubesgl.kernels.gemv import linear
    from kubesgl.kernels.gemv_triton import gemv

    rand = seeded_rand()

    ws = layer_weights(rand)
    nw = 1 + 0.1 * rand(1024)
    for m in (1, 2, 4):
        for name in ("qkv", "o", "gate_up", "down"):
            x = rand(m, SHAPES[name][1])
            nbytes = ws[0][name].numel() * 2
            for impl, fn in (("cublas", F.linear), ("gemv", gemv)):
                err = rel_err(fn(x, ws[0][name]), F.linear(x.float(), ws[0][name].float()))
                sec = graph_seconds(lambda x=x, fn=fn, name=name: [fn(x, w[name]) for w in ws], len(ws))
                row = {"part": "gemv", "what": name, "m": m, "impl": impl, "us": sec * 1e6,
                       "TBps": nbytes / sec / 1e12, "rel_err": err}  # fmt: skip
                emit(row, path)
        layer = layer_projections(ws, nw, rand(m, 1024), rand(m, 1024), rand(m, 2048), lin=linear)
        for on in ("0", "1"):
            os.environ["KUBESGL_GEMV"] = on  # kernels/gemv.py reads the switch at every call (capture time)
            emit(
                {
                    "part": "gemv",
                    "what": "layer",
                    "m": m,
                    "gemv": on == "1",
                    "us": graph_seconds(layer, 8) * 1e6,
                },
                path,
            )
    os.environ.pop("KUBESGL_GEMV")


# --- attention ----------------------------------------------------------------------------------------


def part_attn(path: str | None) -> None:
    from attention_bw import DTYPE, HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, _flashinfer, decode_batch, time_decode
    from attention_bw import decode_inputs as attn_inputs
    from kubesgl.attention.triton_backend import TritonAttention
    from kubesgl.kv.kv_cache import KVCache

    rng = random.Random(0)

    def ragged(bs: int) -> list[int]:  # a live request: its prompt plus what it generated so far
        return [rng.randint(100, 1024) + rng.randint(0, rng.randint(100, 1024)) for _ in range(bs)]

    cases = {
        "256xragged": ragged(256),
        "256x850": [850] * 256,
        "64xragged": ragged(64),
        "16xragged": ragged(16),
    }
    kv = KVCache(
        1,
        max(sum(-(-n // PAGE) for n in c) for c in cases.values()) + 2,
        PAGE,
        KV_HEADS,
        HEAD_DIM,
        DTYPE,
        "cuda",
    )
    kv.k_pages(0).normal_()
    kv.v_pages(0).normal_()

    def triton(schedule: str, waves: float = 8.0) -> Any:
        return TritonAttention(device="cuda", num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                               decode_schedule=schedule, plan_waves=waves)  # fmt: skip

    variants: list[tuple[str, Callable[[], Any]]] = [("triton-split", lambda: triton("split"))]
    variants += [(f"triton-planned-w{w:g}", lambda w=w: triton("planned", w)) for w in PLAN_WAVES]
    variants.append(("flashinfer", lambda: _flashinfer(use_tensor_cores=True)))
    for case, seq_lens in cases.items():
        meta, out_loc = decode_batch(seq_lens, kv)
        qkv = attn_inputs(len(seq_lens))
        kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
        ref = None
        for label, make in variants:
            try:
                seconds, out = time_decode(make(), meta, out_loc, kv, qkv)
            except Exception as e:
                print(f"attn {case} {label}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            ref = out if ref is None else ref
            diff = (out.float() - ref.float()).abs().max().item()
            emit({"part": "attn", "case": case, "backend": label, "us": seconds * 1e6,
                  "TBps": kv_bytes / seconds / 1e12, "max_diff_vs_split": diff, "ok": diff < 2e-2}, path)  # fmt: skip


# --- summary ------------------------------------------------------------------------------------------


def summary(path: str) -> None:
    rows = []
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f]
    copy = next((r["TBps"] for r in rows if r["part"] == "copy"), float("nan"))
    bad = [r for r in rows if r.get("ok") is False]
    print(
        f"\n==== kernel_bench summary (copy bandwidth {copy:.2f} TB/s; {len(bad)} rows failed their check) ===="
    )
    lat = [r for r in rows if r["part"] == "latency"]
    if lat:
        for r in lat:
            if r["what"] == "kernel_boundary":
                print(f"Kernel boundary in a graph (1,000 one-element kernels): {r['us']:.2f} us per kernel")
        print("Projection latency, us (TB/s): weight cold (HBM) and hot (L2), cuBLAS vs cuBLASLt")
        print(
            f"{'shape':8} {'M':>4} {'cuBLAS cold':>14} {'cuBLAS hot':>14} {'cuBLASLt cold':>14} {'cuBLASLt hot':>14}"
        )
        gemm = {(r["shape"], r["m"], r["blas"]): r for r in lat if r["what"] == "gemm"}

        def lat_cell(r: dict | None, key: str) -> str:
            return (
                f"{r[key + '_us']:7.1f} ({r[key + '_TBps']:4.2f})" if r and key + "_us" in r else f"{'-':>14}"
            )

        for name in SHAPES:
            for m in ROWS:
                c, lt = gemm.get((name, m, "cublas")), gemm.get((name, m, "cublaslt"))
                if c or lt:
                    cells = (
                        lat_cell(c, "cold"),
                        lat_cell(c, "hot"),
                        lat_cell(lt, "cold"),
                        lat_cell(lt, "hot"),
                    )
                    print(f"{name:8} {m:>4} " + " ".join(cells))
        layers = {(r["m"], r["blas"]): r["us"] for r in lat if r["what"] == "layer"}
        for m in ROWS:
            if (m, "cublas") in layers and (m, "cublaslt") in layers:
                a, b = layers[(m, "cublas")], layers[(m, "cublaslt")]
                print(
                    f"  layer M {m:>3}: cuBLAS {a:6.1f} us  cuBLASLt {b:6.1f} us  => {(a - b) * 28 / 1e3:+.3f} ms per step"
                )
    pdl = {(r["what"], r.get("m"), r["pdl"]): r["us"] for r in rows if r["part"] == "pdl"}
    if pdl:
        print("Programmatic dependent launch, us, off -> on (same process)")
        off, on = pdl.get(("triton_chain", None, False)), pdl.get(("triton_chain", None, True))
        if off is not None and on is not None:
            print(
                f"  Triton -> Triton boundary (1,000 chained RMSNorms): {off:.2f} -> {on:.2f} us per kernel"
            )
        for m in ROWS:
            off, on = pdl.get(("layer", m, False)), pdl.get(("layer", m, True))
            if off is not None and on is not None:
                print(
                    f"  layer M {m:>3}: {off:6.1f} -> {on:6.1f} us  => {(off - on) * 28 / 1e3:+.3f} ms per step"
                )
    mlp = {(r["m"], r["impl"]): r for r in rows if r["part"] == "mlp"}
    if mlp:
        print("Decode MLP per layer, us (TB/s of weights): unfused (3 kernels) vs fused (1)")
        for m in sorted({m for m, _ in mlp}):
            a, b, b32 = mlp.get((m, "unfused")), mlp.get((m, "fused")), mlp.get((m, "fused/32"))
            if a and b:
                print(
                    f"  M {m:>2}: {_cell(a)} -> {_cell(b)} (slices of 32: {_cell(b32)})"
                    f"  => {(a['us'] - b['us']) * 28 / 1e3:+.3f} ms per step"
                )
    attn = [r for r in rows if r["part"] == "attn"]
    if attn:
        print("Decode attention, TB/s of KV read (us per layer call)")
        cases = list(dict.fromkeys(r["case"] for r in attn))
        backends = list(dict.fromkeys(r["backend"] for r in attn))
        print(f"{'backend':22}" + "".join(f"{c:>20}" for c in cases))
        for b in backends:
            cells = []
            for c in cases:
                r = next((r for r in attn if r["case"] == c and r["backend"] == b), None)
                cells.append(
                    f"{r['TBps']:6.2f} ({r['us']:7.1f}){'!' if not r['ok'] else ' '}" if r else f"{'-':>20}"
                )
            print(f"{b:22}" + "".join(f"{cell:>20}" for cell in cells))
    for r in bad:
        print("CHECK FAILED:", r)


def _cell(r: dict | None) -> str:
    return f"{r['us']:7.1f} ({r['TBps']:4.2f}){'!' if not r['ok'] else ''}" if r else f"{'-':>14}"


def _ratio(base: dict | None, new: dict | None) -> str:
    return f"{base['us'] / new['us']:5.2f}" if base and new else f"{'-':>5}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=["copy", "latency", "attn", "pdl", "mlp", "gemv"])
    p.add_argument("--json", default=None, help="append rows here")
    p.add_argument("--summary", default=None, help="print the summary table of these rows and exit")
    args = p.parse_args()
    if args.summary:
        summary(args.summary)
        return 0
    if not torch.cuda.is_available():
        print("kernel_bench needs a CUDA device", file=sys.stderr)
        return 2
    t0 = time.time()
    {"copy": lambda: part_copy(args.json), "latency": lambda: part_latency(args.json),
     "attn": lambda: part_attn(args.json), "pdl": lambda: part_pdl(args.json),
     "mlp": lambda: part_mlp(args.json), "gemv": lambda: part_gemv(args.json)}[args.part]()  # fmt: skip
    print(f"{args.part} done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
