"""Where a decode step's device time goes, kernel by kernel (torch.profiler over steady decode steps).

For each batch size: `bs` requests with `--context`-token prompts are prefilled, decoded a few steps to warm
up, then `--steps` decode steps run under torch.profiler (CUDA activity, which sees the kernels inside CUDA
graph replays). Prints, per batch size, the step time by CUDA events, the kernel count and kernel time per
step, and the top kernels by total time; `--json` appends one line per batch size. `--prefill-tokens N` adds one
N-token prefill step; `--mixed-decode 64,256` a mixed step (`--enable-mixed-chunk`: an 8k chunk carrying that
many decoding requests) against the plain extend step and the decode step it would have stalled.

    python benchmark/kernel_trace.py --model Qwen3-0.6B --batch-sizes 1,64,256 --context 800
    python benchmark/kernel_trace.py --batch-sizes "" --mixed-decode 16,64,256 --context 800
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import json
import pstats
import time
from collections import defaultdict
from typing import Any


def short(name: str, width: int = 90) -> str:
    name = name.replace("void ", "")
    return name if len(name) <= width else name[: width - 3] + "..."


def trace_batch(llm: Any, bs: int, context: int, steps: int, top: int) -> dict[str, Any]:
    import torch
    from kubesgl import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    warm = 4
    params = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=warm + steps + 64)
    rids = [f"trace-{bs}-{i}" for i in range(bs)]
    for i, rid in enumerate(rids):
        eng.add_request(rid, [(7 * i + j) % 10000 for j in range(context)], params)
    produced: dict[str, int] = defaultdict(int)
    while len(produced) < bs or min(produced.values()) < warm:  # prefill, then a few decode steps
        for out in eng.step():
            produced[out.rid] += len(out.new_token_ids)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        end.record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    step_ms = start.elapsed_time(end) / steps
    for rid in rids:
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    head = (
        f"bs {bs}, context {context}: {step_ms:.3f} ms/step (events), {wall / steps * 1e3:.3f} ms/step wall"
    )
    return report(prof, steps, head, top) | {"bs": bs, "context": context, "step_ms": round(step_ms, 4)}


def trace_prefill(
    llm: Any, tokens: int, context: int, top: int, host_profile: bool = False
) -> dict[str, Any]:
    """One chunked-prefill step of about `tokens` new tokens (requests of `context` tokens, no cache hits)."""
    import torch
    from kubesgl import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    n = max(1, tokens // context)
    for warm in (True, False):  # a first step of this shape pays one-time costs (GEMM heuristics, plans)
        for i in range(n):  # distinct first tokens: no prefix-cache hits
            prompt = [(10007 + 13 * i + 7 * j + 5000 * warm) % 10000 for j in range(context)]
            eng.add_request(f"prefill-{warm}-{i}", prompt, SamplingParams(max_tokens=2))
        if warm:
            while eng.has_work():
                eng.step()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    host = cProfile.Profile() if host_profile else None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start.record()
        if host is not None:
            host.enable()
        eng.step()
        if host is not None:
            host.disable()
        end.record()
        torch.cuda.synchronize()
    ms = start.elapsed_time(end)
    if host is not None:  # where the host's time to enqueue the step goes
        print(f"\n== host profile of the prefill step ({n} x {context} tokens), by own time", flush=True)
        pstats.Stats(host).sort_stats("tottime").print_stats(25)
    while eng.has_work():
        eng.step()
    head = f"prefill of {n} x {context} tokens: {ms:.3f} ms (events)"
    return report(prof, 1, head, top) | {"prefill_tokens": n * context, "step_ms": round(ms, 4)}


def trace_mixed(llm: Any, bs: int, tokens: int, context: int, top: int) -> dict[str, Any]:
    """A prefill chunk with `bs` decoding requests (of `context`-token prompts) riding along, against the same
    chunk as a plain extend step followed by the decode step of those `bs` requests (`--enable-mixed-chunk`
    toggled on the scheduler). The chunk is `tokens` - bs new tokens, as the mixed budget leaves it; its
    requests end at prefill (max_tokens 1), so the unmixed decode step holds exactly the `bs` decoders."""
    import dataclasses

    import torch
    from kubesgl import SamplingParams
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    sched = eng.scheduler
    decode = SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=4096)
    rids = [f"mixed-{bs}-{i}" for i in range(bs)]
    for i, rid in enumerate(rids):
        eng.add_request(rid, [(11 * i + j) % 10000 for j in range(context)], decode)
    produced: dict[str, int] = defaultdict(int)
    while len(produced) < bs or min(produced.values()) < 4:  # prefilled, then decoding
        for out in eng.step():
            produced[out.rid] += len(out.new_token_ids)
    chunk = tokens - bs
    lengths = [context] * (chunk // context) + ([chunk % context] if chunk % context else [])
    rounds = itertools.count()

    def add_prefill() -> None:
        n = next(rounds)
        for i, length in enumerate(lengths):  # distinct first tokens: no prefix-cache hits
            prompt = [(9973 * n + 31 * i + 7 * j) % 10000 for j in range(length)]
            eng.add_request(f"chunk-{bs}-{n}-{i}", prompt, SamplingParams(max_tokens=1))

    def timed_step(top: int) -> tuple[str, float, dict[str, Any]]:
        """One engine step: the kind of step it launched, its device ms (events), its kernels."""
        before = sched.counters.steps.copy()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            eng.step()
            end.record()
            torch.cuda.synchronize()
        (kind,) = (sched.counters.steps - before).keys()
        ms = start.elapsed_time(end)
        head = f"{kind} step ({bs} decoding, {chunk}-token chunk): {ms:.3f} ms (events)"
        return kind, ms, report(prof, 1, head, top) if top else {}

    res: dict[str, Any] = {"mixed_decode_bs": bs, "prefill_tokens": chunk, "context": context}
    for mixed in (True, False):
        sched.limits = dataclasses.replace(sched.limits, enable_mixed_chunk=mixed)
        for warm in (True, False):  # the first step of a shape pays one-time costs (GEMM heuristics, plans)
            add_prefill()
            steps = [timed_step(0 if warm else top) for _ in range(1 if mixed else 2)]
            kinds = [k for k, _, _ in steps]
            assert kinds == (["mixed"] if mixed else ["extend", "decode"]), kinds
            if not warm:
                res.update({f"{k}_ms": round(ms, 4) for k, ms, _ in steps})
                res.update({f"{k}_ops": r["ops_per_step"] for k, _, r in steps})
    res["saved_ms"] = round(res["extend_ms"] + res["decode_ms"] - res["mixed_ms"], 4)
    print(
        f"== mixed {bs} + {chunk}: mixed step {res['mixed_ms']:.3f} ms vs extend {res['extend_ms']:.3f} + decode "
        f"{res['decode_ms']:.3f} ms: saves {res['saved_ms']:.3f} ms",
        flush=True,
    )
    for rid in rids:
        eng.abort(rid)
    while eng.has_work():
        eng.step()
    return res


def report(prof: Any, steps: int, head: str, top: int) -> dict[str, Any]:
    import torch

    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        dur = getattr(ev, "device_time", None)
        if dur is None:
            dur = ev.cuda_time
        k = kernels[ev.name]
        k[0] += 1
        k[1] += dur
    total_us = sum(v[1] for v in kernels.values())
    count = sum(v[0] for v in kernels.values())
    rows = sorted(kernels.items(), key=lambda kv: -kv[1][1])
    print(
        f"\n== {head}; {count / steps:.0f} device ops/step, {total_us / steps / 1e3:.3f} ms of kernels/step",
        flush=True,
    )
    print(f"{'calls/step':>10} {'us/step':>9} {'us/call':>8}  kernel")
    for name, (n, us) in rows[:top]:
        print(f"{n / steps:10.1f} {us / steps:9.1f} {us / n:8.2f}  {short(name)}")
    return {
        "ops_per_step": round(count / steps, 1),
        "kernel_ms_per_step": round(total_us / steps / 1e3, 4),
        "top": [
            [short(name, 200), round(n / steps, 2), round(us / steps, 2)] for name, (n, us) in rows[:top]
        ],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--attn", default="auto")
    p.add_argument("--batch-sizes", default="1,64,256")
    p.add_argument("--context", type=int, default=800)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument(
        "--enable-torch-compile", action="store_true", help="the compiled forward (engine/compile.py)"
    )
    p.add_argument("--torch-compile-max-bs", type=int, default=32)
    p.add_argument("--page-size", type=int, default=1, help="KV page size (the offline benchmark's is 16)")
    p.add_argument("--prefill-tokens", type=int, default=0, help="also trace one prefill step of ~N tokens")
    p.add_argument("--host-profile", action="store_true", help="cProfile the host side of the prefill step")
    p.add_argument(
        "--mixed-decode",
        default="",
        help="decode batch sizes: trace a mixed step (a --prefill-tokens chunk, 8192 if 0, carrying that many "
        "decoding requests) against the unmixed extend + decode steps",
    )
    p.add_argument("--json", default=None)
    args = p.parse_args()

    from kubesgl import LLM
    from kubesgl.bench.offline import _resolve_model
    from kubesgl.engine.compile import compile_figures

    model_dir, dummy = _resolve_model(args.model)
    sizes = [int(s) for s in args.batch_sizes.split(",") if s]
    mixed_sizes = [int(s) for s in args.mixed_decode.split(",") if s]
    chunk_tokens = args.prefill_tokens or 8192
    llm = LLM(
        model_dir,
        device="cuda",
        attn=args.attn,
        dummy_weight=dummy,
        # A mixed trace holds its decoders plus the chunk's requests.
        max_running_requests=max(sizes + [b + chunk_tokens // args.context + 2 for b in mixed_sizes]),
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        page_size=args.page_size,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs,
    )
    compiled = compile_figures(llm.engine.runner.compiled)
    print(f"attention backend: {type(llm.engine.runner.attn).__name__}; {compiled}", flush=True)
    runs = [lambda bs=bs: trace_batch(llm, bs, args.context, args.steps, args.top) for bs in sizes]
    if args.prefill_tokens:
        runs.append(
            lambda: trace_prefill(llm, args.prefill_tokens, args.context, args.top, args.host_profile)
        )
    runs += [lambda bs=bs: trace_mixed(llm, bs, chunk_tokens, args.context, args.top) for bs in mixed_sizes]
    for run in runs:
        res = run()
        res.update(model=args.model, attn=type(llm.engine.runner.attn).__name__, **compiled)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps(res) + "\n")
    llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
