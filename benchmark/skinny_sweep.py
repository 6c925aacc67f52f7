"""The mid-batch GEMM (kernels/gemm_triton.py) against cuBLAS at Qwen3-0.6B's projection shapes, for decode batches
of 8-256 rows: every candidate config per (shape, rows), the best one kept where it beats cuBLAS, then a decoder
layer's projections and norms over 8 layers with the table off and on. Writes the table the engine reads
(KUBESGL_SKINNY_CONFIGS) and prints one summary.

    python benchmark/skinny_sweep.py --json $OUT/skinny.jsonl --table $OUT/skinny_table.json

Timing: each projection over 8 layers' weights in turn (more than L2 holds) in a CUDA graph, median of 30 replays
(`kernel_bench.graph_seconds`); gate_up is timed with its SiLU·mul (cuBLAS + our silu_and_mul kernel against the
folded kernel), since that pair is what the fold replaces. A config whose output is off F.linear's float32 result by
more than bf16 rounding is dropped.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernel_bench import BF16, SHAPES, emit, graph_seconds, layer_projections, rel_err  # noqa: E402

ROWS = [8, 16, 32, 64, 128, 256]
PROJECTIONS = ("qkv", "o", "gate_up", "down")
WIN = 0.97  # a config enters the table only if it takes at most this share of cuBLAS's time
MAX_REL_ERR = 0.01  # bf16 rounding of the output (2^-8 relative) with margin; a wrong tile is far off


def candidates(m: int, n: int, k: int, silu: bool, sms: int) -> list[Any]:
    """Configs worth timing: a rows tile that covers the batch (64 or 128 above 64 rows), output tiles of 32-128
    weight rows, K steps of 64 or 128, and K splits only where the output tiles alone leave multiprocessors idle."""
    from kubesgl.kernels.gemm_config import GemmConfig

    pow2 = 1 << (m - 1).bit_length()
    block_ms = [max(16, pow2)] if m <= 64 else [64, 128]
    out = []
    for bm in block_ms:
        for bn in (32, 64, 128):
            for bk in (64, 128):
                tiles = -(-m // bm) * -(-n // bn)
                for split in (1, 2, 4, 8):
                    if split > 1 and (silu or tiles >= 2 * sms or tiles * split > 4 * sms or k // split < bk):
                        continue
                    if tiles * split < sms // 4:
                        continue
                    warps = 8 if bn * bm >= 128 * 64 else 4
                    out.append(GemmConfig(bm, bn, bk, split, warps, 4 if bk == 64 else 3))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None, help="append every timed row here")
    p.add_argument("--table", required=True, help="write the winning configs here (KUBESGL_SKINNY_CONFIGS)")
    p.add_argument("--rows", default=",".join(map(str, ROWS)))
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("skinny_sweep needs a CUDA device", file=sys.stderr)
        return 2
    from kubesgl.kernels.activation import silu_and_mul
    from kubesgl.kernels.gemm_triton import skinny_gemm
    from kubesgl.kernels.gemv import linear

    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, device="cuda", dtype=torch.float32) * scale).to(BF16)

    ws = [
        {name: rand(*SHAPES[name], scale=SHAPES[name][1] ** -0.5) for name in PROJECTIONS} for _ in range(8)
    ]
    table: dict[str, str] = {}
    best_rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for name in PROJECTIONS:
            n, k = SHAPES[name]
            silu = name == "gate_up"
            x = rand(m, k)
            ref = F.linear(x.float(), ws[0][name].float())
            if silu:
                gate, up = ref.chunk(2, dim=-1)
                ref = F.silu(gate.to(BF16).float()) * up.to(BF16).float()
                base = lambda x=x, name=name: [silu_and_mul(F.linear(x, w[name])) for w in ws]  # noqa: E731
            else:
                base = lambda x=x, name=name: [F.linear(x, w[name]) for w in ws]  # noqa: E731
            cublas = graph_seconds(base, len(ws)) * 1e6
            emit({"part": "skinny", "what": name, "m": m, "impl": "cublas", "us": cublas}, args.json)
            best: tuple[float, str] | None = None
            out_n = n // 2 if silu else n
            for cfg in candidates(m, out_n, k, silu, sms):
                try:
                    err = rel_err(skinny_gemm(x, ws[0][name], cfg, silu=silu), ref)
                    run = lambda x=x, name=name, cfg=cfg, silu=silu: [  # noqa: E731
                        skinny_gemm(x, w[name], cfg, silu=silu) for w in ws
                    ]
                    us = graph_seconds(run, len(ws)) * 1e6
                except Exception as e:  # a config Triton cannot build (shared memory, registers): skipped
                    emit(
                        {"part": "skinny", "what": name, "m": m, "cfg": cfg.key(), "error": str(e)[:200]},
                        args.json,
                    )
                    continue
                ok = err < MAX_REL_ERR
                row = {"part": "skinny", "what": name, "m": m, "impl": "triton", "cfg": cfg.key(), "us": us,
                       "rel_err": err, "ok": ok}  # fmt: skip
                emit(row, args.json)
                if ok and (best is None or us < best[0]):
                    best = (us, cfg.key())
            if best is not None:
                best_rows.append((name, m, cublas, best[0], best[1]))
                if best[0] <= WIN * cublas:
                    table[f"{out_n},{k},{int(silu)},{m}"] = best[1]
    with open(args.table, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "configs": table}, f, indent=1)
    os.environ["KUBESGL_SKINNY_CONFIGS"] = os.path.abspath(args.table)

    nw = 1 + 0.1 * rand(1024)

    def layer(m: int) -> Any:
        return layer_projections(ws, nw, rand(m, 1024), rand(m, 1024), rand(m, 2048), linear, fold_silu=True)

    layers = []
    for m in (int(v) for v in args.rows.split(",")):
        run = layer(m)
        us = {}
        for on in ("0", "1"):
            os.environ["KUBESGL_SKINNY_GEMM"] = on  # read at every call (capture time)
            us[on] = graph_seconds(run, len(ws)) * 1e6
            emit({"part": "skinny", "what": "layer", "m": m, "skinny": on == "1", "us": us[on]}, args.json)
        layers.append((m, us["0"], us["1"]))
    os.environ.pop("KUBESGL_SKINNY_GEMM")

    print(
        f"\n==== mid-batch GEMM vs cuBLAS, {torch.cuda.get_device_name()} ({sms} SMs), us per projection ===="
    )
    for name, m, cublas, us, key in best_rows:
        mark = "table" if us <= WIN * cublas else "cuBLAS kept"
        print(
            f"  {name:8} M {m:>3}: cuBLAS {cublas:6.2f}  best {us:6.2f} ({key})  x{cublas / us:4.2f}  {mark}"
        )
    print("  a decoder layer's projections + norms (8 layers in a graph), us per layer: off -> on")
    for m, off, on in layers:
        print(f"  M {m:>3}: {off:6.1f} -> {on:6.1f}  => {(off - on) * 28 / 1e3:+.3f} ms per 28-layer step")
    print(f"table: {len(table)} entries -> {args.table}; sweep took {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
