"""Does a decode step's projection work hide under its attention when the batch runs as two halves on two streams?

Issue 25's next lever (docs/performance.md, fifteenth session): at 128-256 rows a decode step is ~2/3 attention
(bound by HBM) and ~1.2-1.4 ms of projections, norms and small kernels (bound by their fixed costs, not by the
tensor cores). Two half-batches are independent until the LM head, so each can run its 28 layers on its own stream
inside one CUDA graph and the GPU can put one half's projections beside the other half's attention. The price: the
projections run twice at half the rows, and at 64-128 rows they cost nearly what they cost at 256.

This measures the lever before it is built into the engine, with the engine's own kernels: the planned Triton
decode over a ragged batch (workload-like lengths, seeded; one layer's KV cache re-read per layer call, more than L2
holds) and a decoder layer's projections and norms (`kernels.gemv.linear` / `gate_up_silu`, so cuBLAS or the
mid-batch GEMM by its table, 8 layers' weights in turn). Per step of `--layers` layers, CUDA-graph replays:

    full       the whole batch: attention, then projections, per layer (today's decode step, less LM head/sampling)
    halves     two half-batches one after the other on one stream (what the split costs with no overlap)
    overlap    the two halves on two streams, forked and joined inside the graph
    attn/proj  each part alone, for the whole batch and for a half

    python benchmark/overlap_probe.py [--bs 256] [--layers 28] [--json out.jsonl]

It pays if `overlap` < `full`; `hidden` = (halves - overlap) / min(half parts) says how much of the smaller part the
GPU hid (1 = all of it).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_bw import DTYPE, HEAD_DIM, KV_HEADS, PAGE, Q_HEADS, decode_batch  # noqa: E402
from kernel_bench import emit, layer_step, layer_weights, replay_seconds, seeded_rand  # noqa: E402

HIDDEN = 1024


def workload_lens(bs: int, seed: int = 0) -> list[int]:
    """Seeded ragged decode lengths like the seed workload's: 100-1,024 tokens plus up to as many again."""
    rng = random.Random(seed)
    return [rng.randint(100, 1024) + rng.randint(0, rng.randint(100, 1024)) for _ in range(bs)]


def random_kv(pages: int) -> Any:
    """One layer's paged KV cache of `pages` pages (plus the reserved ones) filled with randn."""
    from kubesgl.kv.kv_cache import KVCache

    kv = KVCache(1, pages + 2, PAGE, KV_HEADS, HEAD_DIM, DTYPE, "cuda")
    kv.k_pages(0).normal_()
    kv.v_pages(0).normal_()
    return kv


def planned_decode(seq_lens: list[int], kv: Any) -> tuple[Any, Any]:
    """(metadata, backend): the engine's planned Triton decode for a batch of these lengths (pages in random order),
    set up for graph capture; `backend.plan_replay(meta, len(seq_lens))` loads the real work lists after it."""
    from kubesgl.attention.triton_backend import TritonAttention

    meta, _ = decode_batch(seq_lens, kv)
    backend = TritonAttention(device="cuda", num_q_heads=Q_HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)
    backend.init_cuda_graph(len(seq_lens), meta.page_table.shape[1])
    backend.plan_capture(len(seq_lens))
    return meta, backend


def capture(parts: list[Callable[[], None]]) -> torch.cuda.CUDAGraph:
    """One graph: parts[0] on the capture stream, each further part on a stream of its own, forked from the
    capture stream at the start and joined at the end (after a warm-up of each part on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for part in parts:
            part()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream() for _ in parts[1:]]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream()
        for s in streams:
            s.wait_stream(main)
        parts[0]()
        for s, part in zip(streams, parts[1:], strict=True):
            with torch.cuda.stream(s):
                part()
        for s in streams:
            main.wait_stream(s)
    return graph


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bs", type=int, default=256)
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("overlap_probe needs a CUDA device", file=sys.stderr)
        return 2
    from kubesgl.kernels.gemv import linear

    lens = workload_lens(args.bs)
    batches = {"full": lens, "a": lens[0::2], "b": lens[1::2]}  # alternate rows: halves of like length
    kv = random_kv(2 * sum(-(-n // PAGE) for n in lens))
    rand = seeded_rand(DTYPE)

    ws = layer_weights(rand)
    nw = 1 + 0.1 * rand(HIDDEN)
    state: dict[str, dict[str, Any]] = {}
    for name, seq_lens in batches.items():
        meta, backend = planned_decode(seq_lens, kv)
        bs = len(seq_lens)
        state[name] = {
            "meta": meta,
            "backend": backend,
            "q": torch.randn((bs, Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda"),
            "h": rand(bs, HIDDEN),
            "r": rand(bs, HIDDEN),
        }

    def step(name: str, attention: bool = True, projections: bool = True) -> Callable[[], None]:
        """`args.layers` decoder layers of one batch: its attention, its projections and norms, or both."""
        s = state[name]
        attn_out = s["q"].view(s["q"].shape[0], -1)

        def attend() -> None:
            s["backend"].forward(s["q"], 0, kv, HEAD_DIM**-0.5)

        def run() -> None:
            h, r = s["h"], s["r"]
            for layer in range(args.layers):
                if not projections:
                    attend()
                    continue
                w = ws[layer % len(ws)]
                h, r = layer_step(
                    w, h, r, attn_out, nw, linear, fold_silu=True, attend=attend if attention else None
                )

        return run

    graphs = {
        "full": capture([step("full")]),
        "halves": capture([lambda: (step("a")(), step("b")())]),
        "overlap": capture([step("a"), step("b")]),
        "attn_full": capture([step("full", projections=False)]),
        "proj_full": capture([step("full", attention=False)]),
        "attn_half": capture([step("a", projections=False)]),
        "proj_half": capture([step("a", attention=False)]),
    }
    for name, s in state.items():  # the work lists of the real lengths, into each backend's graph buffers
        s["backend"].plan_replay(s["meta"], len(batches[name]))
    ms = {name: replay_seconds(g, 10) * 1e3 for name, g in graphs.items()}
    small = min(ms["attn_half"], ms["proj_half"])
    ms["hidden"] = (ms["halves"] - ms["overlap"]) / small if small > 0 else float("nan")
    row = {"part": "overlap", "device": torch.cuda.get_device_name(), "bs": args.bs, "layers": args.layers}
    emit({**row, **{k: round(v, 4) for k, v in ms.items()}}, args.json)
    print(
        f"{args.bs} rows, {args.layers} layers, ms per step: full {ms['full']:.3f}  halves {ms['halves']:.3f}  "
        f"overlap {ms['overlap']:.3f} ({ms['full'] / ms['overlap']:.3f}x of full); parts: attention "
        f"{ms['attn_full']:.3f} / half {ms['attn_half']:.3f}, projections {ms['proj_full']:.3f} / half "
        f"{ms['proj_half']:.3f}; hidden {ms['hidden']:.2f} of the smaller half part"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
