"""What an eager extend (prefill) step costs the host against the device, by step shape.

A served burst's first steps are small (one or two requests arrive before the rest), and each took ~14-22 ms
on the lent H100 (`KUBESGL_STEP_LOG`: `launch_ms` of an 8-token extend step 13.8-14.3 ms, of a 983-token one
21.9 ms) where a decode step's graph launches in 0.7 ms. This script asks whether that is the host (Python,
aten dispatch, kernel launches) or a wait on the device: for each shape, `--repeat` fresh extend steps, each
from an idle device (synchronized first), timed as the host's wall time inside `Engine.step()` (with overlap
scheduling the step returns once launched) and the device's time by CUDA events; then one step of the largest
shape under torch.profiler with CPU activity: the aten ops and CUDA runtime calls by self CPU time (a
`cudaStreamSynchronize` or blocking copy there is a wait, not work). Prints tables; `--json` appends a line per
shape. Asserts nothing.

    python benchmark/extend_host.py --model Qwen3-0.6B --shapes 1x8,1x1000,8x1000,16x512
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import zlib
from typing import Any

VOCAB = 10000  # prompt token ids below this (every model here has more)


def one_step(llm: Any, rows: int, tokens: int, tag: str) -> tuple[float, float]:
    """Adds `rows` requests of `tokens` new tokens (no prefix-cache hits) to an idle engine, times the step that
    prefills them (host wall ms inside step(), device ms by events), then lets them finish."""
    import torch
    from kubesgl import SamplingParams

    eng = llm.engine
    assert not eng.has_work()
    for i in range(rows):
        prompt = [(zlib.crc32(f"{tag}-{i}".encode()) % 9000 + 11 * j) % VOCAB for j in range(tokens)]
        eng.add_request(f"{tag}-{i}", prompt, SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    eng.step()
    host_ms = (time.perf_counter() - t0) * 1e3
    end.record()
    torch.cuda.synchronize()
    device_ms = start.elapsed_time(end)
    while eng.has_work():
        eng.step()
    return host_ms, device_ms


def profile_step(llm: Any, rows: int, tokens: int, top: int) -> None:
    import torch
    from kubesgl import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    for i in range(rows):
        prompt = [(zlib.crc32(f"prof-{i}".encode()) % 9000 + 13 * j) % VOCAB for j in range(tokens)]
        eng.add_request(f"prof-{i}", prompt, SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step()
        host_ms = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernel_ms = sum(e.device_time for e in kernels) / 1e3
    while eng.has_work():
        eng.step()
    print(
        f"\n== one extend step of {rows} x {tokens} tokens under torch.profiler: host {host_ms:.2f} ms (profiled), "
        f"{len(kernels)} kernels, {kernel_ms:.2f} ms of kernel time; by self CPU time:"
    )
    print(f"{'calls':>7} {'self us':>9} {'us/call':>8}  op")
    rows_ = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    rows_ = [e for e in rows_ if e.self_cpu_time_total > 0]
    for e in rows_[:top]:
        print(
            f"{e.count:7d} {e.self_cpu_time_total:9.0f} {e.self_cpu_time_total / e.count:8.1f}  {e.key[:90]}"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--attn", default="auto")
    p.add_argument("--shapes", default="1x8,1x1000,8x1000,16x512", help="ROWSxTOKENS, comma-separated")
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--top", type=int, default=30)
    p.add_argument(
        "--cuda-graph-max-bs", type=int, default=0, help="decode graphs (no extend step uses them)"
    )
    p.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=0,
        help="extend steps of at most this many tokens replay piecewise graphs (0: every step eager)",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from kubesgl import LLM
    from kubesgl.bench.offline import _resolve_model

    model_dir, dummy = _resolve_model(args.model)
    llm = LLM(
        model_dir,
        device="cuda",
        attn=args.attn,
        dummy_weight=dummy,
        page_size=args.page_size,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
    )
    pw = llm.engine.runner.prefill_graphs
    print(
        f"attention backend: {type(llm.engine.runner.attn).__name__}; piecewise graphs: "
        + (
            f"{len(pw.sizes)} buckets <= {pw.max_tokens}, captured in {pw.capture_seconds:.1f} s"
            if pw
            else "off"
        ),
        flush=True,
    )
    shapes = [tuple(int(x) for x in s.split("x")) for s in args.shapes.split(",") if s]
    print(f"{'rows x tokens':>14} {'host ms (median, min)':>22} {'device ms (median)':>19}")
    for rows, tokens in shapes:
        one_step(llm, rows, tokens, f"warm-{rows}-{tokens}")  # first of a shape: heuristics, plans
        runs = [one_step(llm, rows, tokens, f"r{k}-{rows}-{tokens}") for k in range(args.repeat)]
        host = [h for h, _ in runs]
        dev = [d for _, d in runs]
        line = {
            "rows": rows,
            "tokens": tokens,
            "host_ms": round(statistics.median(host), 3),
            "host_min_ms": round(min(host), 3),
            "device_ms": round(statistics.median(dev), 3),
            "model": args.model,
            "attn": type(llm.engine.runner.attn).__name__,
            "piecewise_max_tokens": pw.max_tokens if pw else 0,
        }
        print(
            f"{rows:>6} x {tokens:<6} {line['host_ms']:>12.2f} {line['host_min_ms']:>8.2f} {line['device_ms']:>19.2f}"
        )
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(line) + "\n")
    rows, tokens = shapes[-1]
    profile_step(llm, rows, tokens, args.top)
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
