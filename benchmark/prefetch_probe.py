"""Do a decode step's projections run faster when their weights are pulled into L2 while attention drains?

Issue 25's bound (docs/performance.md, fifteenth and sixteenth sessions): at 32-256 rows a decode step carries
~1.2-1.4 ms of non-attention work, of which the four projections of 28 layers take ~0.8-1.1 ms, where their
bytes (31 MB a layer, 0.87 GB a step) take ~0.3 ms at HBM bandwidth. Each GEMM is 4-13 MB: it streams at
1.1-1.5 TB/s because its first wave's loads, its tail and the launch before it leave HBM idle. Between one
layer's attention and the next layer's attention the work is one chain: o, add + norm, gate_up, SiLU·mul, down,
add + norm, next qkv, next qkv prep, whose weights (o, gate_up, down and the next layer's qkv: 31 MB) fit in the
50 MB L2. Issued as prefetches the moment attention ends, those 31 MB stream at HBM rate behind the GEMMs, which
then read L2.

This measures the lever before it is built into the engine, with the engine's own kernels as overlap_probe.py
runs them (the planned Triton decode over a ragged batch, a layer's projections and norms through
`kernels.gemv.linear`, 8 layers' weights in turn, CUDA-graph replays), per step of `--layers` layers:

    base         attention, then the projections, per layer (today's decode step, less LM head and sampling)
    pf           + one prefetch kernel after attention: `prefetch.global.L2` of every 128-byte line of o, gate_up,
                 down and the next layer's qkv in one launch (PDL: it may start while attention's last wave drains)
    proj         the projections alone (no attention between layers), and proj_pf with the prefetch

    python benchmark/prefetch_probe.py [--bs 256,128,64,16] [--layers 28] [--json out.jsonl]

It pays if pf < base by more than the prefetch kernel's own launch.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from attention_bw import DTYPE, HEAD_DIM, PAGE, Q_HEADS  # noqa: E402
from kernel_bench import emit, layer_step, layer_weights, replay_seconds, seeded_rand  # noqa: E402
from kubesgl.kernels.pdl import pdl_kwargs  # noqa: E402
from kubesgl.kernels.pdl_triton import pdl_launch_dependents, pdl_wait  # noqa: E402
from overlap_probe import HIDDEN, capture, planned_decode, random_kv, workload_lens  # noqa: E402

LINE = 128  # bytes per L2 line
LINES = 512  # lines per program


@triton.jit
def _prefetch(base, n, chunk, LINES: tl.constexpr):
    # lines past the tensor's end are clamped to its last line (a repeated hint costs nothing)
    offs = tl.minimum(chunk * LINES + tl.arange(0, LINES), n - 1).to(tl.int64) * 128
    tl.inline_asm_elementwise(
        "prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
        "=r,l",
        [base + offs],
        dtype=tl.int32,
        is_pure=False,
        pack=1,
    )


@triton.jit
def _prefetch_kernel(p0, n0, p1, n1, p2, n2, p3, n3, LINES: tl.constexpr, USE_PDL: tl.constexpr):
    """Programs laid out tensor by tensor (n*: each byte view's line count)."""
    pid = tl.program_id(0)
    c0 = tl.cdiv(n0, LINES)
    c1 = c0 + tl.cdiv(n1, LINES)
    c2 = c1 + tl.cdiv(n2, LINES)
    if pid < c0:
        _prefetch(p0, n0, pid, LINES)
    elif pid < c1:
        _prefetch(p1, n1, pid - c0, LINES)
    elif pid < c2:
        _prefetch(p2, n2, pid - c1, LINES)
    else:
        _prefetch(p3, n3, pid - c2, LINES)
    pdl_wait(USE_PDL)  # completes after its predecessor, as every PDL kernel of ours
    pdl_launch_dependents(USE_PDL)


def prefetch_l2(weights: list[torch.Tensor]) -> None:
    """Prefetch hints for every line of 1-4 contiguous CUDA tensors, in one launch (PDL: it may start while the
    kernel before it drains; it completes after it)."""
    views = [w.view(-1).view(torch.uint8) for w in weights]
    lines = [triton.cdiv(v.numel(), LINE) for v in views]
    while len(views) < 4:  # unused slots: no lines, so no program reads their pointer
        views, lines = [*views, views[0]], [*lines, 0]
    grid = (sum(triton.cdiv(n, LINES) for n in lines),)
    args = [a for v, n in zip(views, lines, strict=True) for a in (v, n)]
    _prefetch_kernel[grid](*args, LINES=LINES, num_warps=4, **pdl_kwargs(views[0]))


def probe(bs: int, layers: int, path: str | None) -> None:
    from kubesgl.kernels.gemv import linear

    lens = workload_lens(bs)
    kv = random_kv(sum(-(-n // PAGE) for n in lens))
    rand = seeded_rand(DTYPE)
    ws = layer_weights(rand)
    nw = 1 + 0.1 * rand(HIDDEN)
    meta, backend = planned_decode(lens, kv)
    q = torch.randn((bs, Q_HEADS, HEAD_DIM), dtype=DTYPE, device="cuda")
    h0, r0 = rand(bs, HIDDEN), rand(bs, HIDDEN)
    attn_out = q.view(bs, -1)

    def step(attention: bool, prefetch: bool) -> Callable[[], None]:
        def run() -> None:
            h, r = h0, r0
            for layer in range(layers):
                w, nxt = ws[layer % len(ws)], ws[(layer + 1) % len(ws)]

                def attend(w=w, nxt=nxt) -> None:
                    if attention:
                        backend.forward(q, 0, kv, HEAD_DIM**-0.5)
                    if prefetch:
                        prefetch_l2([w["o"], w["gate_up"], w["down"], nxt["qkv"]])

                h, r = layer_step(w, h, r, attn_out, nw, linear, fold_silu=True, attend=attend)

        return run

    variants = {"base": (True, False), "pf": (True, True), "proj": (False, False), "proj_pf": (False, True)}
    graphs = {name: capture([step(*v)]) for name, v in variants.items()}
    backend.plan_replay(meta, bs)
    # Two rounds: the first brings the clocks up before the first variant is timed; the second gives the figures.
    ms = {name: replay_seconds(g, 10) * 1e3 for name, g in graphs.items()}
    ms = {name: replay_seconds(g, 10) * 1e3 for name, g in graphs.items()}
    row = {"part": "prefetch", "device": torch.cuda.get_device_name(), "bs": bs, "layers": layers}
    emit({**row, **{k: round(v, 4) for k, v in ms.items()}}, path)
    print(
        f"{bs} rows, {layers} layers, ms per step: base {ms['base']:.3f}  prefetch {ms['pf']:.3f} "
        f"({ms['base'] / ms['pf']:.3f}x); projections alone {ms['proj']:.3f}, with prefetch {ms['proj_pf']:.3f} "
        f"({ms['proj'] / ms['proj_pf']:.3f}x)",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bs", default="256,128,64,16")
    p.add_argument("--layers", type=int, default=28)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("prefetch_probe needs a CUDA device", file=sys.stderr)
        return 2
    for bs in (int(b) for b in args.bs.split(",")):
        probe(bs, args.layers, args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
