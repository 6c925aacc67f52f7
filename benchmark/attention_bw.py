"""Decode-attention bandwidth per backend on Qwen3-0.6B shapes (and extend-attention throughput).

Decode is memory-bound: the figure of merit is bytes of KV read / time. Each backend runs through its
CUDA-graph hooks (init_cuda_graph, plan_capture, plan_replay), the way the model runner drives it, with
10 layer calls per graph so launch gaps stay out of the numbers. Pages are handed out in random order.

    python benchmark/attention_bw.py [--backends triton,flashinfer] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from typing import Any

import torch
from kubesgl.attention.base import AttentionMetadata
from kubesgl.attention.registry import create_backend
from kubesgl.kv.kv_cache import KVCache

Q_HEADS, KV_HEADS, HEAD_DIM, PAGE = 16, 8, 128, 16  # Qwen3-0.6B
DTYPE = torch.bfloat16
CALLS_PER_GRAPH = 10
# (block_n, num_warps, num_stages, splits): tile length x warps x pipelining depth x split-KV slices.
TRITON_SWEEP = [
    (*cfg, splits)
    for cfg in [(32, 4, 3), (64, 4, 2), (64, 4, 3), (64, 8, 3), (128, 8, 2), (128, 8, 3)]
    for splits in (1, 2, 4)
]


def emit(row: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    rows.append(row)
    print(
        "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True
    )


def copy_bandwidth() -> float:
    """Device-to-device copy TB/s (bytes read + written), the ceiling decode attention is measured against."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / median_seconds(lambda: dst.copy_(src), 20) / 1e12


def median_seconds(fn: Any, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def decode_batch(seq_lens: list[int], kv: KVCache) -> tuple[AttentionMetadata, torch.Tensor]:
    pages = [-(-n // PAGE) for n in seq_lens]
    order = torch.randperm(kv.num_pages - 1)[: sum(pages)] + 1
    table = torch.zeros((len(seq_lens), max(pages)), dtype=torch.int32)
    out_loc = []
    start = 0
    for i, (n, p) in enumerate(zip(seq_lens, pages, strict=True)):
        table[i, :p] = order[start : start + p]
        start += p
        out_loc.append(int(table[i, (n - 1) // PAGE]) * PAGE + (n - 1) % PAGE)
    meta = AttentionMetadata(
        mode="decode",
        page_size=PAGE,
        seq_lens=seq_lens,
        extend_lens=[1] * len(seq_lens),
        prefix_lens=[n - 1 for n in seq_lens],
        page_table=table.cuda(),
        seq_lens_dev=torch.tensor(seq_lens, dtype=torch.int32, device="cuda"),
    )
    return meta, torch.tensor(out_loc, device="cuda")


def decode_inputs(bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    q = torch.randn((bs, Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    k = torch.randn((bs, KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    return q, k, torch.randn_like(k)


def time_decode(
    backend: Any, meta: AttentionMetadata, out_loc: torch.Tensor, kv: KVCache, qkv: tuple[torch.Tensor, ...]
) -> tuple[float, torch.Tensor]:
    """Seconds per layer call of the captured decode, and the output (for cross-checking backends)."""
    bs = meta.batch_size
    q, k, v = qkv
    kv.store(0, out_loc, k, v)  # the layer's job; the timed calls only attend
    backend.init_cuda_graph(bs, meta.page_table.shape[1])
    backend.plan_capture(bs)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        backend.forward(q, 0, kv, HEAD_DIM**-0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            out = backend.forward(q, 0, kv, HEAD_DIM**-0.5)
    backend.plan_replay(meta, bs)
    seconds = median_seconds(graph.replay, 20) / CALLS_PER_GRAPH
    return seconds, out.clone()


def make(name: str) -> Any:
    return create_backend(
        name,
        device="cuda",
        page_size=PAGE,
        num_q_heads=Q_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        dtype=DTYPE,
    )


def bench_decode(backends: list[str], rows: list[dict[str, Any]], ceiling: float) -> None:
    rng = random.Random(0)
    cases = {
        "256x850": [850] * 256,
        "256xragged": [rng.randint(100, 1600) for _ in range(256)],
        "32x850": [850] * 32,
        "4x4096": [4096] * 4,
    }
    kv = KVCache(1, 256 * 1700 // PAGE + 2, PAGE, KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    kv.k_pages(0).normal_()
    kv.v_pages(0).normal_()
    for case, seq_lens in cases.items():
        meta, out_loc = decode_batch(seq_lens, kv)
        qkv = decode_inputs(len(seq_lens))
        kv_bytes = sum(seq_lens) * KV_HEADS * HEAD_DIM * 2 * DTYPE.itemsize
        outputs: dict[str, torch.Tensor] = {}
        variants: list[tuple[str, dict[str, Any]]] = []
        for name in backends:
            if name == "triton":
                variants.append(("triton", {}))
            elif name == "flashinfer":
                variants += [
                    ("flashinfer", {"use_tensor_cores": False}),
                    ("flashinfer", {"use_tensor_cores": True}),
                ]
        for name, kw in variants:
            label = name + ("+tc" if kw.get("use_tensor_cores") else "")
            try:
                backend = make(name) if not kw else _flashinfer(**kw)
                seconds, out = time_decode(backend, meta, out_loc, kv, qkv)
            except Exception as e:  # report and go on: one backend failing must not hide the others
                print(f"decode {case} {label}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            outputs[label] = out
            diff = (out.float() - next(iter(outputs.values())).float()).abs().max().item()
            tbs = kv_bytes / seconds / 1e12
            emit(
                {"bench": "decode", "case": case, "backend": label, "us": seconds * 1e6, "TBps": tbs,
                 "of_copy_bw": tbs / ceiling, "max_diff_vs_first": diff},
                rows,
            )  # fmt: skip
        if "triton" in outputs and case in ("256x850", "256xragged"):
            sweep_triton(case, meta, out_loc, kv, qkv, kv_bytes, outputs["triton"], rows)


def _flashinfer(use_tensor_cores: bool) -> Any:
    from kubesgl.attention.flashinfer_backend import FlashInferAttention

    return FlashInferAttention(
        device="cuda", num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE, dtype=DTYPE,
        use_tensor_cores=use_tensor_cores,
    )  # fmt: skip


def sweep_triton(
    case: str,
    meta: AttentionMetadata,
    out_loc: torch.Tensor,
    kv: KVCache,
    qkv: tuple[torch.Tensor, ...],
    kv_bytes: int,
    ref: torch.Tensor,
    rows: list,
) -> None:
    from kubesgl.attention.triton_backend import TritonAttention

    for block_n, warps, stages, splits in TRITON_SWEEP:
        backend = TritonAttention(
            device="cuda", num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
            decode_block_n=block_n, decode_num_warps=warps, decode_num_stages=stages, fixed_decode_splits=splits,
        )  # fmt: skip
        try:
            seconds, out = time_decode(backend, meta, out_loc, kv, qkv)
        except Exception as e:
            print(f"sweep {block_n}/{warps}/{stages}/{splits}: FAILED {type(e).__name__}: {e}", flush=True)
            continue
        emit({"bench": "triton_sweep", "case": case, "block_n": block_n, "warps": warps, "stages": stages, "splits": splits,
              "us": seconds * 1e6, "TBps": kv_bytes / seconds / 1e12,
              "max_diff_vs_default": (out.float() - ref.float()).abs().max().item()}, rows)  # fmt: skip


def time_extend(
    backend: Any, meta: AttentionMetadata, qkv: tuple[torch.Tensor, ...], kv: KVCache, out_loc: torch.Tensor
) -> float:
    q, k, v = qkv
    kv.store(0, out_loc, k, v)  # the layer's job; the timed calls only attend
    backend.plan(meta)
    return median_seconds(lambda: backend.forward(q, 0, kv, HEAD_DIM**-0.5), 20)


def bench_extend(backends: list[str], rows: list[dict[str, Any]]) -> None:
    """Prefill of 8 requests x 1024 new tokens behind 0 or 512 cached tokens: causal attention TFLOP/s."""
    for prefix in (0, 512):
        n_req, new = 8, 1024
        seq = prefix + new
        kv = KVCache(1, n_req * seq // PAGE + 2, PAGE, KV_HEADS, HEAD_DIM, DTYPE, "cuda")
        kv.k_pages(0).normal_()
        kv.v_pages(0).normal_()
        table = (torch.randperm(kv.num_pages - 1)[: n_req * seq // PAGE] + 1).view(n_req, -1).to(torch.int32)
        pos = torch.arange(prefix, seq)
        out_loc = torch.cat([table[i, pos // PAGE].long() * PAGE + pos % PAGE for i in range(n_req)]).cuda()
        meta = AttentionMetadata(
            mode="extend", page_size=PAGE, seq_lens=[seq] * n_req, extend_lens=[new] * n_req,
            prefix_lens=[prefix] * n_req, page_table=table.cuda(),
            seq_lens_dev=torch.full((n_req,), seq, dtype=torch.int32, device="cuda"),
        )  # fmt: skip
        t = n_req * new
        q = torch.randn((t, Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
        k = torch.randn((t, KV_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
        v = torch.randn_like(k)
        # Query j sees prefix + j + 1 keys: 4 * D flops per (query, key) pair per head (QK^T and PV).
        pairs = n_req * sum(prefix + j + 1 for j in range(new))
        flops = 4 * HEAD_DIM * Q_HEADS * pairs
        for name in backends:
            try:
                seconds = time_extend(make(name), meta, (q, k, v), kv, out_loc)
            except Exception as e:
                print(f"extend prefix={prefix} {name}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            emit({"bench": "extend", "case": f"8x1024+{prefix}", "backend": name, "us": seconds * 1e6,
                  "TFLOPs": flops / seconds / 1e12}, rows)  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="triton,flashinfer")
    parser.add_argument("--json", default=None, help="write all rows here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("attention_bw needs a CUDA device", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    ceiling = copy_bandwidth()
    emit({"bench": "copy", "device": torch.cuda.get_device_name(), "TBps": ceiling}, rows)
    bench_decode(backends, rows, ceiling)
    bench_extend(backends, rows)
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
