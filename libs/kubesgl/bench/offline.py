"""`kubesgl bench offline`: the seeds' offline throughput benchmark, with the device's memory-bound ceiling.

Workload (Mini-SGLang's): python `random` seeded 0; first the prompts, each of randint(min_in, max_in) token ids
drawn with randint(0, 10000), then each request's max_tokens randint(min_out, max_out); temperature 0.6; EOS
ignored; one warm-up request. Throughput = output tokens / wall time.

`--json-fraction F`: that share of the requests (drawn with python `random` seeded 1) carries BENCH_SCHEMA as a
JSON-schema constraint; they end when their JSON does (so the run has fewer output tokens), and the line reports
tok/s, how many constrained outputs parse and validate, and the grammar compile cache. The warm-up compiles the
schema, so the timed run measures masking and matching, not the one-off compile.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable
from typing import Any

from kubesgl.runtime.process import freeze_heap


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="Qwen3-0.6B", help="model dir, or a real config name run on random weights"
    )
    p.add_argument("--num-seqs", type=int, default=256)
    p.add_argument("--min-input", type=int, default=100)
    p.add_argument("--max-input", type=int, default=1024)
    p.add_argument("--min-output", type=int, default=100)
    p.add_argument("--max-output", type=int, default=1024)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--attn", default="auto")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=None,
        help="extend steps of at most this many tokens replay piecewise CUDA graphs (default: the prefill chunk, at most 8192; "
        "0 disables)",
    )
    p.add_argument("--disable-overlap", action="store_true")
    p.add_argument(
        "--enable-torch-compile",
        action="store_true",
        help="decode batches up to --torch-compile-max-bs run the forward compiled by Inductor (SGLang's flag)",
    )
    p.add_argument("--torch-compile-max-bs", type=int, default=32)
    p.add_argument(
        "--enable-mixed-chunk",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="prefill steps carry the decode batch (SGLang's mixed chunk)",
    )
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--max-prefill-length", type=int, default=8192)
    p.add_argument(
        "--hf-baseline", type=int, default=0, help="also run HF transformers on this many requests"
    )
    p.add_argument(
        "--json-fraction", type=float, default=0.0, help="share of requests constrained to a JSON schema"
    )
    p.add_argument("--json", default=None, help="append the figures as one JSON line to this file")


# A small fixed schema: bounded strings and arrays, so a constrained output ends inside its max_tokens.
BENCH_SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 1000000},
        "name": {"type": "string", "maxLength": 48},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 6},
        "ok": {"type": "boolean"},
    },
    "required": ["id", "name", "tags", "ok"],
    "additionalProperties": False,
}


def make_workload(args: argparse.Namespace, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    prompts = [
        [rng.randint(0, 10000) for _ in range(rng.randint(args.min_input, args.max_input))]
        for _ in range(args.num_seqs)
    ]
    max_tokens = [rng.randint(args.min_output, args.max_output) for _ in range(args.num_seqs)]
    return prompts, max_tokens


def _rate_per_second(op: Callable[[], object], work_per_op: float, reps: int = 20) -> float:
    """`work_per_op` (bytes, FLOPs) over the seconds one `op` takes on the GPU, after 3 warm-up runs."""
    import torch

    for _ in range(3):
        op()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        op()
    torch.cuda.synchronize()
    return work_per_op * reps / (time.perf_counter() - t)


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write), measured now."""
    import torch

    if device != "cuda":
        return float("nan")
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _rate_per_second(lambda: dst.copy_(src), 2 * n)


def gemm_flops(device: str) -> float:
    """bf16 GEMM rate in FLOP/s (an 8192-cube matmul), measured now: the rate prefill's projections can reach."""
    import torch

    if device != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    return _rate_per_second(lambda: a @ b, 2 * n**3)


def memory_bound_seconds(
    prompts: list[list[int]],
    max_tokens: list[int],
    weight_bytes: int,
    kv_bytes_per_token: int,
    bw: float,
    max_bs: int,
) -> float:
    """Time if every decode step only read the weights once and each live sequence's KV once, at `bw`."""
    total, live = 0.0, []
    queue = [(len(p), n) for p, n in zip(prompts, max_tokens, strict=True)]
    while queue or live:
        while queue and len(live) < max_bs:
            n_in, n_out = queue.pop(0)
            live.append([n_in, n_out])
        kv = sum(s[0] for s in live)
        total += (weight_bytes + kv * kv_bytes_per_token) / bw
        for s in live:
            s[0] += 1
            s[1] -= 1
        live = [s for s in live if s[1] > 0]
    return total


def prefill_flop_seconds(
    prompts: list[list[int]], layer_macs_per_token: int, num_layers: int, attn_width: int, rate: float
) -> float:
    """Time if prefill only did its multiply-adds at `rate`: each prompt token through every layer's weights
    (`layer_macs_per_token`, all layers; a MoE's active experts only) plus causal attention (QK and PV over
    the tokens before it: `attn_width` = query heads x head_dim per layer). The LM head runs on one row per
    prompt and is left out."""
    flops = 0
    for p in prompts:
        n = len(p)
        flops += 2 * layer_macs_per_token * n + 2 * 2 * num_layers * attn_width * n * (n + 1) // 2
    return flops / rate


def layer_macs_per_token(model: Any) -> int:
    """Multiply-adds one token costs in the decoder layers' projections (a MoE counts its top-k experts)."""
    from kubesgl.models.hf_config import num_experts_of

    config = model.hf_config
    macs = 0
    for name, p in model.model.layers.named_parameters():
        if p.dim() < 2:
            continue  # norms and biases
        if name.split(".")[-2:-1] == ["experts"]:  # experts.w13 / experts.w2: top-k of them per token
            macs += p.numel() * config.num_experts_per_tok // num_experts_of(config)
        else:
            macs += p.numel()
    return macs


def json_figures(llm: Any, outs: list[dict[str, Any]], fraction: float) -> dict[str, Any]:
    """How the constrained requests of a --json-fraction run did: finished JSON that validates, and tokens."""
    import jsonschema

    valid = 0
    for o in outs:
        try:
            jsonschema.validate(json.loads(o["text"]), BENCH_SCHEMA)
            valid += o["finish_reason"] == "stop"
        except (ValueError, jsonschema.ValidationError):
            pass
    grammars = llm.engine.grammars
    cache = grammars.cache_info() if grammars is not None else None  # the warm-up's one compile: 1 miss
    return {
        "json_fraction": fraction,
        "json_requests": len(outs),
        "json_valid": valid,
        "json_output_tokens": sum(len(o["token_ids"]) for o in outs),
        "grammar_cache_misses": cache.misses if cache else None,
    }


def _resolve_model(name: str) -> tuple[str, bool]:
    if os.path.isdir(name):
        return name, False
    from kubesgl.models.random_init import write_config_only

    out = os.path.join(tempfile.gettempdir(), "kubesgl-bench", name)
    return str(write_config_only(name, out)), True


def run_hf_baseline(
    model_dir: str, prompts: list[list[int]], max_tokens: list[int], device: str
) -> dict[str, Any]:
    """HF transformers generate() on the same weights config (random), padded batch, EOS ignored."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(model_dir)
    model = (
        AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16, attn_implementation="sdpa")
        .to(device)
        .eval()
    )
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    torch.cuda.synchronize()
    t = time.perf_counter()
    with torch.no_grad():
        model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max(max_tokens),
            min_new_tokens=max(max_tokens),
            do_sample=True,
            temperature=0.6,
            top_k=0,
            pad_token_id=0,
        )
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    useful = sum(max_tokens)
    return {"hf_requests": len(prompts), "hf_seconds": dt, "hf_output_tok_s": useful / dt}


def main(args: argparse.Namespace) -> int:
    from dataclasses import replace

    import torch

    from kubesgl import LLM, SamplingParams
    from kubesgl.engine.compile import compile_figures
    from kubesgl.engine.step_profile import StepProfile
    from kubesgl.kernels.gemv import skinny_table_size
    from kubesgl.kv.kv_cache import KVCache
    from kubesgl.values.constraint import Constraint

    model_dir, dummy = _resolve_model(args.model)
    if args.json_fraction > 0 and dummy:  # random weights on a real config: Qwen3's tokenizer for the grammar
        from kubesgl.models.random_init import TOKENIZER_FILES, qwen3_tokenizer_dir

        for name in TOKENIZER_FILES:
            shutil.copyfile(qwen3_tokenizer_dir() / name, os.path.join(model_dir, name))
    prompts, max_tokens = make_workload(args)
    bw = copy_bandwidth(args.device)
    t0 = time.perf_counter()
    llm = LLM(
        model_dir,
        device=args.device,
        dtype=args.dtype,
        attn=args.attn,
        page_size=args.page_size,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
        disable_overlap=args.disable_overlap,
        enable_mixed_chunk=args.enable_mixed_chunk,
        enable_torch_compile=args.enable_torch_compile,
        torch_compile_max_bs=args.torch_compile_max_bs,
        dummy_weight=dummy,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_length,
    )
    startup = time.perf_counter() - t0
    freeze_heap()  # as the serving processes do once started (runtime.process), so both pay the same GC
    m = llm.engine.runner.model
    weight_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    kv_tok = KVCache.bytes_per_token(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype)
    schema = Constraint.json_schema(BENCH_SCHEMA) if args.json_fraction > 0 else None
    warm = SamplingParams(max_tokens=8, constraint=schema)
    llm.generate([[1, 2, 3, 4]], warm)  # warm-up (and the schema compiled)
    sched = llm.engine.scheduler
    warm_steps, warm_rows = sched.counters.steps.copy(), sched.counters.mixed_decode_rows
    params = [SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in max_tokens]
    pick = random.Random(1)
    constrained = [i for i in range(len(params)) if schema is not None and pick.random() < args.json_fraction]
    for i in constrained:
        params[i] = replace(params[i], constraint=schema)
    if args.device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    if args.device == "cuda":
        torch.cuda.synchronize()
    dt = time.perf_counter() - t
    out_tokens = sum(len(o["token_ids"]) for o in outs)
    free = [i for i in range(len(outs)) if params[i].constraint is None]
    assert all(len(outs[i]["token_ids"]) == max_tokens[i] for i in free), "EOS is ignored: max_tokens each"
    ideal = (
        memory_bound_seconds(prompts, max_tokens, weight_bytes, kv_tok, bw, args.max_running_requests)
        if bw == bw
        else float("nan")
    )
    flops = gemm_flops(args.device)
    attn = m.model.layers[0].self_attn.attn
    prefill = prefill_flop_seconds(
        prompts, layer_macs_per_token(m), m.num_layers, attn.num_heads * attn.head_dim, flops
    )
    if isinstance(llm.engine.step_hook, StepProfile):
        print(llm.engine.step_hook.report(), flush=True)
    graphs, piecewise = llm.engine.runner.graphs, llm.engine.runner.prefill_graphs
    res: dict[str, Any] = {
        "model": args.model,
        "attn": type(llm.engine.runner.attn).__name__,
        "attn_spec": args.attn,
        "overlap": llm.engine.overlap,
        "mixed_chunk": args.enable_mixed_chunk,
        "max_prefill_length": args.max_prefill_length,
        "blas": torch.backends.cuda.preferred_blas_library().name if args.device == "cuda" else None,
        "skinny_gemm_shapes": skinny_table_size(),  # mid-batch GEMM table entries in force (0: cuBLAS)
        "cuda_graph_max_bs": graphs.max_bs if graphs else 0,
        "graph_capture_s": round(graphs.capture_seconds, 2) if graphs else 0.0,  # compile included
        "piecewise_max_tokens": piecewise.max_tokens if piecewise else 0,
        "piecewise_capture_s": round(piecewise.capture_seconds, 2) if piecewise else 0.0,
        **compile_figures(llm.engine.runner.compiled),
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "output_tokens": out_tokens,
        "seconds": round(dt, 3),
        "output_tok_s": round(out_tokens / dt, 1),
        "startup_s": round(startup, 1),
        "copy_bw_TBps": round(bw / 1e12, 3),
        "ceiling_seconds": round(ideal, 3),
        "ceiling_tok_s": round(out_tokens / ideal, 1) if ideal == ideal else None,
        "ratio_to_ceiling": round(ideal / dt, 3) if ideal == ideal else None,
        # The second term: prefill's multiply-adds at the measured bf16 GEMM rate, added to the decode bytes.
        "gemm_TFLOPs": round(flops / 1e12, 1) if flops == flops else None,
        "prefill_flop_seconds": round(prefill, 3) if prefill == prefill else None,
        "ceiling_with_prefill_tok_s": round(out_tokens / (ideal + prefill), 1)
        if prefill == prefill
        else None,
        "ratio_to_ceiling_with_prefill": round((ideal + prefill) / dt, 3) if prefill == prefill else None,
        "preemptions": llm.engine.stats().retracted_total,
        # Steps of the run by kind (the warm-up's excluded) and the decode rows that rode in mixed steps.
        **{
            f"steps_{kind}": sched.counters.steps[kind] - warm_steps[kind]
            for kind in ("extend", "mixed", "decode")
        },
        "mixed_decode_rows": sched.counters.mixed_decode_rows - warm_rows,
    }
    if schema is not None:
        res.update(json_figures(llm, [outs[i] for i in constrained], args.json_fraction))
    llm.shutdown()
    if args.hf_baseline:
        del llm
        torch.cuda.empty_cache()
        hf = run_hf_baseline(
            model_dir, prompts[: args.hf_baseline], max_tokens[: args.hf_baseline], args.device
        )
        hf["hf_ratio"] = round(res["output_tok_s"] / hf["hf_output_tok_s"], 1)
        res.update(hf)
    print(json.dumps(res), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0
