"""The mid-batch GEMM (kernels/gemm_triton.py) against the kernels it replaces at Qwen3-0.6B's projection shapes, for
decode batches of 8-256 rows: every candidate config per (shape, op, rows), the best one kept where it beats them,
then a decoder layer's projections, norms and qkv prep over 8 layers with the table off and on. The ops: each
projection alone against cuBLAS (gate_up with its SiLU·mul, against cuBLAS + silu_and_mul), and qkv with its prep
(prep: q/k norm, RoPE, KV store; against the best qkv projection + the qkv_prep kernel). Writes the table the engine
reads (KUBESGL_SKINNY_CONFIGS) and prints one summary.

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

from kernel_bench import (  # noqa: E402
    SHAPES,
    emit,
    graph_seconds,
    layer_projections,
    layer_weights,
    qkv_prep_args,
    rel_err,
    seeded_rand,
)

ROWS = [8, 16, 32, 64, 128, 256]
# (projection, op): the projections alone (gate_up with its SiLU·mul), then qkv with its prep (q/k norm, RoPE, KV
# store) after it, timed against the table the plain cases just wrote.
CASES = (("qkv", "linear"), ("o", "linear"), ("gate_up", "silu"), ("down", "linear"), ("qkv", "prep"))
WIN = 0.97  # a config enters the table only if it takes at most this share of the unfused kernels' time
MAX_REL_ERR = 0.01  # bf16 rounding of the output (2^-8 relative) with margin; a wrong tile is far off
HEAD_HALF = 64  # Qwen3's head_dim / 2: the PREP epilogue's block_n


def candidates(
    m: int,
    n: int,
    k: int,
    sms: int,
    block_ns: tuple[int, ...] = (32, 64, 128),
    block_ks: tuple[int, ...] = (64, 128),
    max_block_m: int = 128,
) -> list[Any]:
    """Configs worth timing: a rows tile that covers the batch (64 or 128 above 64 rows, at most `max_block_m`),
    output tiles of `block_ns` weight rows (n / block_n tiles across), K steps of `block_ks`, and K splits only
    where the output tiles alone leave multiprocessors idle."""
    from kubesgl.kernels.gemm_config import GemmConfig

    pow2 = 1 << (m - 1).bit_length()
    block_ms = [max(16, pow2)] if m <= 64 else [bm for bm in (64, 128) if bm <= max(64, max_block_m)]
    out = []
    for bm in block_ms:
        for bn in block_ns:
            for bk in block_ks:
                tiles = -(-m // bm) * -(-n // bn)
                for split in (1, 2, 4, 8):
                    if split > 1 and (tiles >= 2 * sms or tiles * split > 4 * sms or k // split < bk):
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
    p.add_argument(
        "--ops",
        default=None,
        help="sweep only these ops (comma-separated); the others keep the built-in table's",
    )
    p.add_argument(
        "--block-n", default="32,64,128", help="output tiles to try (the qkv prep's is head_dim / 2)"
    )
    p.add_argument("--block-k", default="64,128", help="K steps to try")
    p.add_argument("--max-block-m", type=int, default=128, help="largest rows tile to try above 64 rows")
    args = p.parse_args()
    ops = set(args.ops.split(",")) if args.ops else {op for _, op in CASES}
    block_ns = tuple(int(v) for v in args.block_n.split(","))
    block_ks = tuple(int(v) for v in args.block_k.split(","))
    if not torch.cuda.is_available():
        print("skinny_sweep needs a CUDA device", file=sys.stderr)
        return 2
    from kubesgl.kernels import gemm_triton
    from kubesgl.kernels import gemv as gemv_module
    from kubesgl.kernels.activation import silu_and_mul
    from kubesgl.kernels.gemv import linear

    t0 = time.time()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rand = seeded_rand()

    ws = layer_weights(rand)
    nw = 1 + 0.1 * rand(1024)
    # The ops not swept keep the built-in table's entries, so the table written stands for all of them.
    table = {
        f"{n},{k},{op},{b}": key for (n, k, op, b), key in gemv_module.SKINNY_TABLE.items() if op not in ops
    }

    def write_table() -> None:
        with open(args.table, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "sms": sms, "configs": table}, f, indent=1)
        gemv_module._table_from.cache_clear()  # read once per path: the next call reads this version

    def unfused(name: str, op: str, x: torch.Tensor, prep: Any) -> Any:
        """What the engine runs without `op`'s kernel (for prep, with the table so far): one layer's."""
        return {
            "linear": lambda w: F.linear(x, w[name]),
            "silu": lambda w: silu_and_mul(F.linear(x, w[name])),
            "prep": lambda w: prep.run(linear(x, w[name])).view(x.shape[0], -1),
        }[op]

    def fused(name: str, op: str, x: torch.Tensor, prep: Any, cfg: Any) -> Any:
        if op == "prep":
            return lambda w: gemm_triton.qkv_prep_gemm(x, w[name], cfg, prep)
        return lambda w: gemm_triton.skinny_gemm(x, w[name], cfg, silu=op == "silu")

    best_rows = []
    for m in (int(v) for v in args.rows.split(",")):
        for name, op in CASES:
            if op not in ops:
                continue
            if op == "prep":  # the unfused baseline takes the table so far
                write_table()
                os.environ["KUBESGL_SKINNY_CONFIGS"] = os.path.abspath(args.table)
            n, k = SHAPES[name]
            x = rand(m, k)
            prep = qkv_prep_args(m) if op == "prep" else None
            base = unfused(name, op, x, prep)
            ref = base(ws[0]).float()
            us_base = graph_seconds(lambda base=base: [base(w) for w in ws], len(ws)) * 1e6
            emit(
                {"part": "skinny", "what": name, "op": op, "m": m, "impl": "unfused", "us": us_base},
                args.json,
            )
            best: tuple[float, str] | None = None
            out_n = n // 2 if op == "silu" else n
            if op == "prep":
                cands = candidates(m, out_n // 2, k, sms, (HEAD_HALF,), block_ks, args.max_block_m)
            else:
                cands = candidates(m, out_n, k, sms, block_ns, block_ks, args.max_block_m)
            failed: list[str] = []
            for cfg in cands:
                run = fused(name, op, x, prep, cfg)
                try:
                    err = rel_err(run(ws[0]), ref)
                    us = graph_seconds(lambda run=run: [run(w) for w in ws], len(ws)) * 1e6
                except Exception as e:  # a config Triton cannot build (shared memory, registers): skipped
                    failed.append(f"{cfg.key()}: {e}")
                    emit(
                        {
                            "part": "skinny",
                            "what": name,
                            "op": op,
                            "m": m,
                            "cfg": cfg.key(),
                            "error": str(e)[:200],
                        },
                        args.json,
                    )
                    continue
                ok = err < MAX_REL_ERR
                row = {"part": "skinny", "what": name, "op": op, "m": m, "impl": "triton", "cfg": cfg.key(),
                       "us": us, "rel_err": err, "ok": ok}  # fmt: skip
                emit(row, args.json)
                if ok and (best is None or us < best[0]):
                    best = (us, cfg.key())
            if best is None and failed:  # every config raised: most likely the harness, not the tiles
                print(f"  {name}/{op} M {m}: all {len(failed)} configs failed, first: {failed[0][:300]}")
            if best is not None:
                best_rows.append((f"{name}/{op}", m, us_base, best[0], best[1]))
                if best[0] <= WIN * us_base:
                    table[f"{out_n},{k},{op},{m}"] = best[1]
    write_table()
    os.environ["KUBESGL_SKINNY_CONFIGS"] = os.path.abspath(args.table)

    def layer(m: int) -> Any:
        return layer_projections(
            ws, nw, rand(m, 1024), rand(m, 1024), rand(m, 2048), linear, fold_silu=True, prep=qkv_prep_args(m)
        )

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
        f"\n==== mid-batch GEMM vs the unfused kernels, {torch.cuda.get_device_name()} ({sms} SMs), us per call ===="
    )
    for what, m, base_us, us, key in best_rows:
        mark = "table" if us <= WIN * base_us else "kept unfused"
        print(
            f"  {what:18} M {m:>3}: unfused {base_us:6.2f}  best {us:6.2f} ({key})  x{base_us / us:4.2f}  {mark}"
        )
    print(
        "  a decoder layer's projections, norms and qkv prep (8 layers in a graph), us per layer: off -> on"
    )
    for m, off, on in layers:
        print(f"  M {m:>3}: {off:6.1f} -> {on:6.1f}  => {(off - on) * 28 / 1e3:+.3f} ms per 28-layer step")
    print(f"table: {len(table)} entries -> {args.table}; sweep took {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
