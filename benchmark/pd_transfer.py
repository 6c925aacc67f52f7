"""Prefill/decode disaggregation on one device: two processes (a prefill engine in a child, a decode engine here),
the prompt's KV pulled through NIXL (kv/kv_transfer.py). Per prompt length: the pull's bandwidth (GB/s of KV),
the TTFT a disaggregated request sees (the prefill instance's first token reaching the decode instance) and
the time until its KV is in place, beside a colocated engine's TTFT on the same prompt (the decode engine run
as `both`). Each prompt is fresh random ids (no prefix hits); the descriptor hop is a multiprocessing queue,
standing in for NATS.

    python benchmark/pd_transfer.py --device cuda --model Qwen3-0.6B --prompts 1024,8192,32768
    python benchmark/pd_transfer.py --device cpu --model demo --prompts 32,128,512   # the CPU exercise
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import time
from typing import Any

from kubesgl import LLM
from kubesgl.bench.offline import _resolve_model
from kubesgl.engine.scheduler.disagg import DecodeRole, KvHandoff, PrefillRole
from kubesgl.kv.kv_transfer import KvTransferAgent
from kubesgl.values.sampling import SamplingParams

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _config(args: argparse.Namespace) -> dict[str, Any]:
    pages = (max(args.prompts) + 64) // args.page_size * 3  # the longest prompt, twice over, and headroom
    model, dummy = (args.model, False) if args.model == "demo" else _resolve_model(args.model)
    return {
        "model_path": model,
        "device": args.device,
        "page_size": args.page_size,
        "num_pages": pages,
        "dummy_weight": dummy,
        "max_prefill_tokens": args.max_prefill_length,
        "cuda_graph_max_bs": args.cuda_graph_max_bs,
    }


def _prefill_process(cfg: dict[str, Any], asks: mp.Queue, handoffs: mp.Queue, done: mp.Queue) -> None:
    model = cfg.pop("model_path")
    with LLM(model, **cfg) as llm:
        role = PrefillRole(llm.engine.scheduler, KvTransferAgent("prefill", llm.engine.runner.kv))
        handoffs.put("ready")
        while (ask := asks.get()) is not None:
            rid, ids = ask
            role.add(rid, ids, PARAMS)
            out: list[KvHandoff] = []
            while not out:
                llm.engine.step()
                out = role.take_handoffs()
            handoffs.put(out[0])
            role.release(done.get())  # the decode side has pulled the pages
        role.agent.close()


def _first_token_s(llm: LLM, rid: str, ids: list[int]) -> float:
    start = time.perf_counter()
    llm.engine.add_request(rid, ids, PARAMS)
    while not any(o.new_token_ids for o in llm.engine.step() if o.rid == rid):
        pass
    took = time.perf_counter() - start
    llm.engine.abort(rid)
    while llm.engine.has_work():
        llm.engine.step()
    return took


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="Qwen3-0.6B")
    p.add_argument("--prompts", default="1024,8192,32768", type=lambda s: [int(x) for x in s.split(",")])
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-prefill-length", type=int, default=8192)
    p.add_argument("--reps", type=int, default=3)
    # Graphs only speed decode steps; TTFT is the prefill's, so 0 (off) saves both engines' capture time.
    p.add_argument("--cuda-graph-max-bs", type=int, default=None)
    p.add_argument("--json", default="")
    args = p.parse_args()
    cfg = _config(args)
    ctx = mp.get_context("spawn")
    asks, handoffs, done = ctx.Queue(), ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_prefill_process, args=(dict(cfg), asks, handoffs, done))
    child.start()
    rng = random.Random(0)
    rows = []
    with LLM(cfg.pop("model_path"), **cfg) as llm:
        agent = KvTransferAgent("decode", llm.engine.runner.kv)
        # a slow pull is measured, not abandoned at the default timeout
        role = DecodeRole(llm.engine.scheduler, agent, timeout_s=120.0)
        assert handoffs.get(timeout=600) == "ready"
        vocab = llm.engine.runner.model.vocab_size
        _first_token_s(llm, "warm", [rng.randrange(vocab) for _ in range(64)])
        for n in args.prompts:
            colo, ttft, ready, gbps, recv = [], [], [], [], []
            for rep in range(args.reps):
                ids = [rng.randrange(vocab) for _ in range(n)]
                colo.append(_first_token_s(llm, f"c{n}-{rep}", ids))
                ids = [rng.randrange(vocab) for _ in range(n)]
                rid = f"d{n}-{rep}"
                start = time.perf_counter()
                asks.put((rid, ids))
                h = handoffs.get(timeout=600)
                ttft.append(time.perf_counter() - start)
                moved = role.counters.transferred_bytes
                got = time.perf_counter()
                role.receive(ids, PARAMS, h)
                recv.append(time.perf_counter() - got)
                while role.busy:
                    role.poll()
                ready.append(time.perf_counter() - start)
                done.put(rid)
                moved = role.counters.transferred_bytes - moved
                # from the handoff's arrival to the pages in place: NIXL may run much of the READ inside
                # receive() (where it is posted), so timing from receive's return overstated the rate
                gbps.append(moved / max(time.perf_counter() - got, 1e-9) / 1e9)
                llm.engine.abort(rid)
                while llm.engine.has_work():
                    llm.engine.step()
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            rows.append(
                {
                    "prompt_tokens": n,
                    "kv_gb": moved / 1e9,
                    "transfer_gbps": med(gbps),
                    "colocated_ttft_ms": 1e3 * med(colo),
                    "disagg_ttft_ms": 1e3 * med(ttft),
                    "kv_ready_ms": 1e3 * med(ready),
                    "added_ttft_ms": 1e3 * (med(ttft) - med(colo)),
                    # make room, allocate, post the READ (NIXL may move much of the data in the post)
                    "receive_ms": 1e3 * med(recv),
                }
            )
        asks.put(None)
        child.join(60)
        agent.close()
    print(f"pd transfer ({args.device}, {args.model}, page {args.page_size}, median of {args.reps})")
    print(
        "prompt  KV GB   pull GB/s  colocated TTFT ms  disagg TTFT ms  KV ready ms  added TTFT ms  receive ms"
    )
    for r in rows:
        print(
            f"{r['prompt_tokens']:>6}  {r['kv_gb']:.4f}  {r['transfer_gbps']:>9.2f}  {r['colocated_ttft_ms']:>17.1f}"
            f"  {r['disagg_ttft_ms']:>14.1f}  {r['kv_ready_ms']:>11.1f}  {r['added_ttft_ms']:>13.1f}  {r['receive_ms']:>10.1f}"
        )
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"device": args.device, "model": args.model, **r}) + "\n")


if __name__ == "__main__":
    main()
