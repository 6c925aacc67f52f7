"""The scheduler's delta delivery at GPU pace, by --detok-batch-size (prints figures, asserts nothing).

The real SchedulerService runs on this process's event loop, fed by a FAKE engine thread (what this is not
about) that steps every running request each `host-ms + gpu-ms`: host-ms of Python holding the GIL, then
gpu-ms asleep, then one token per request. A real nats-server and real detokenizer processes (kubesgl.launcher)
decode; a sink process stands in for the gateway (counts TextDeltas until every request finished) and counts
the messages on the detokenizer subject. Per run: those messages, the scheduler event loop's CPU time, the mean
engine step, tokens/s (admission included, as in b071fba's figures), the gap between a request's successive
TextDeltas (what its client waits: coalescing makes it longer than a step), and how many batches each
detokenizer replica answered (its /metrics).

    .venv/bin/python benchmark/detok_batching.py [--batch-sizes 64,10000] [--repeats 3] [--json out.jsonl]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import nats
from kubesgl import protocol as p
from kubesgl.launcher import Stack, StackConfig, resolve_model
from kubesgl.runtime.telemetry.metrics import SchedulerMetrics, new_registry
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.scheduler.engine_loop import AddRequest, Command, QueryStats
from kubesgl.services.scheduler.service import SchedulerService
from kubesgl.values.outputs import EngineStats, ModelInfo, RequestOutput
from kubesgl.values.sampling import SamplingParams
from prometheus_client.parser import text_string_to_metric_families

GATEWAY = "benchgw"
PAGES = 1_000_000
INFO = ModelInfo("demo", "Qwen3ForCausalLM", 4096, 151936, (151645,), 1, PAGES)

# The gateway's stand-in, in its own process so its work stays off the measured event loop.
SINK = r"""
import asyncio, json, sys, time
import nats
from kubesgl import protocol as p

async def main() -> None:
    nc = await nats.connect(sys.argv[1])
    requests, done = int(sys.argv[2]), asyncio.Event()
    counts = {"text_deltas": 0, "finished": 0, "detok_msgs": 0, "detok_bytes": 0}
    last: dict[str, float] = {}
    gaps: list[float] = []  # between one request's successive TextDeltas: what its client waits

    async def on_text(msg) -> None:
        now = time.monotonic()
        for delta in p.gateway_deltas(msg.data):
            counts["text_deltas"] += 1
            if delta.rid in last:
                gaps.append(now - last[delta.rid])
            last[delta.rid] = now
            if delta.finished:
                counts["finished"] += 1
                if counts["finished"] == requests:
                    done.set()

    async def on_batch(msg) -> None:
        counts["detok_msgs"] += 1
        counts["detok_bytes"] += len(msg.data)

    await nc.subscribe(p.gateway_subject(sys.argv[3]), cb=on_text)
    await nc.subscribe(p.DETOK, cb=on_batch)
    await nc.flush()
    print("ready", flush=True)
    await done.wait()
    await asyncio.sleep(0.2)  # a late resend would still count
    gaps.sort()
    counts["gap_ms_p50"] = round(1000 * gaps[len(gaps) // 2], 1)
    counts["gap_ms_p99"] = round(1000 * gaps[int(len(gaps) * 0.99)], 1)
    print(json.dumps(counts), flush=True)

asyncio.run(main())
"""


class FakeEngineLoop:
    """A FAKE engine thread: admits every request, and once `running` are in, steps them all `tokens` times."""

    def __init__(self, service: SchedulerService, instance: str, args: argparse.Namespace) -> None:
        self._service = service
        self._args = args
        self.stats = EngineStats(0, 0, PAGES, PAGES, PAGES, 0)
        metrics = SchedulerMetrics(new_registry(), "demo", INFO.page_size, INFO.num_pages)
        self.telemetry = SchedulerTelemetry(metrics, Tracing("bench"), instance, "demo")
        self.rids: list[str] = []
        self.step_s: list[float] = []
        self._all_admitted = threading.Event()

    def start(self) -> None:
        self._service.engine_loaded(INFO)
        threading.Thread(target=self._run, name="fake-engine", daemon=True).start()

    def submit(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            self.rids.append(command.rid)
            command.done(None)
            if len(self.rids) == self._args.running:
                self._all_admitted.set()
        elif isinstance(command, QueryStats):
            command.done(self.stats)

    def stop(self, timeout_s: float) -> None:
        pass

    def _run(self) -> None:
        self._all_admitted.wait()
        host_s, gpu_s, tokens = self._args.host_ms / 1000, self._args.gpu_ms / 1000, self._args.tokens
        for i in range(1, tokens + 1):
            start = time.perf_counter()
            while time.perf_counter() < start + host_s:  # the engine's host-side Python, holding the GIL
                pass
            time.sleep(gpu_s)  # the forward pass: the GIL is free
            last = i == tokens
            outputs = [
                RequestOutput(
                    rid, [1000 + i % 500], 3, 0, i, finished=last, finish_reason="length" if last else None
                )
                for rid in self.rids
            ]
            self._service.engine_outputs(outputs, dict.fromkeys(self.rids))
            self.step_s.append(time.perf_counter() - start)


def batches_answered(stack: Stack) -> list[int]:
    """Batches each detokenizer replica answered so far, from its /metrics."""
    out = []
    for svc in stack.services.values():
        if svc.kind != "detokenizer":
            continue
        with urllib.request.urlopen(svc.ready_url.removesuffix("/ready") + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out.append(
            sum(
                int(s.value)
                for family in text_string_to_metric_families(text)
                for s in family.samples
                if s.name == "kubesgl_detokenizer_requests_total"
            )
        )
    return out


async def run_once(stack: Stack, args: argparse.Namespace, batch_size: int, run: int) -> dict[str, Any]:
    sink = subprocess.Popen(
        [sys.executable, "-c", SINK, stack.nats_url, str(args.running), GATEWAY],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert sink.stdout is not None and sink.stdout.readline().strip() == "ready"
    instance = f"bench-{run}"
    engines: list[FakeEngineLoop] = []

    def make_engine(service: SchedulerService) -> FakeEngineLoop:
        engines.append(FakeEngineLoop(service, instance, args))
        return engines[0]

    nc = await nats.connect(stack.nats_url)
    service = SchedulerService(
        nc,
        instance,
        "demo",
        args.running,
        1024,
        make_engine,  # the FAKE engine thread, in the EngineLoop's place
        asyncio.Event(),
        detok_batch_size=batch_size,
    )
    await service.start()
    while not service.ready():
        await asyncio.sleep(0.01)
    client = await nats.connect(stack.nats_url)
    sampling = SamplingParams(max_tokens=args.tokens)
    answered_before = batches_answered(stack)
    cpu0, t0 = time.thread_time(), time.monotonic()  # this thread runs the scheduler's event loop
    admissions = [
        p.GenerateRequest(f"r{i}", GATEWAY, [1, 2, 3], sampling, time.time() + 600)
        for i in range(args.running)
    ]
    await asyncio.gather(
        *(client.request(p.generate_subject(instance), a.to_bytes(), timeout=30) for a in admissions)
    )
    line = await asyncio.to_thread(sink.stdout.readline)
    wall, cpu = time.monotonic() - t0, time.thread_time() - cpu0
    counts = json.loads(line)
    answered = [b - a for a, b in zip(answered_before, batches_answered(stack), strict=True)]
    steps = engines[0].step_s
    await client.close()
    await service.drain(5.0)
    sink.wait(10)
    return {
        "detok_batch_size": batch_size,
        "running": args.running,
        "tokens_each": args.tokens,
        "host_ms": args.host_ms,
        "gpu_ms": args.gpu_ms,
        "detokenizers": args.detokenizers,
        "wall_s": round(wall, 2),
        "ideal_s": round(args.tokens * (args.host_ms + args.gpu_ms) / 1000, 2),
        "engine_step_ms_mean": round(1000 * sum(steps) / len(steps), 2),
        "sched_loop_cpu_s": round(cpu, 2),
        "detok_msgs": counts["detok_msgs"],
        "detok_bytes": counts["detok_bytes"],
        "batches_per_replica": answered,
        "text_deltas": counts["text_deltas"],
        "text_gap_ms_p50": counts["gap_ms_p50"],
        "text_gap_ms_p99": counts["gap_ms_p99"],
        "tokens_per_s": round(args.running * args.tokens / wall),
    }


async def main(args: argparse.Namespace) -> None:
    model, name = resolve_model("demo", None)
    config = StackConfig(
        model_path=model,
        served_model_name=name,
        port=0,
        schedulers=0,
        tokenizers=0,
        gateways=0,
        detokenizers=args.detokenizers,
    )
    stack = Stack(config, tempfile.mkdtemp(prefix="detok-batching-"))
    stack.start()
    try:
        await asyncio.to_thread(stack.wait_ready, 120)
        rows = []
        for _ in range(args.repeats):  # interleaved, so load on a shared box hits every size alike
            for size in args.batch_sizes:
                rows.append(await run_once(stack, args, size, len(rows)))
                print(json.dumps(rows[-1]), flush=True)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(rows[-1]) + "\n")
        keys = ("tokens_per_s", "engine_step_ms_mean", "sched_loop_cpu_s", "detok_msgs", "text_gap_ms_p50")
        for size in args.batch_sizes:
            mine = sorted(
                (row for row in rows if row["detok_batch_size"] == size), key=lambda x: x["tokens_per_s"]
            )
            med = mine[len(mine) // 2]
            print(
                f"--detok-batch-size {size:>6} (median of {len(mine)} by tokens/s): "
                + ", ".join(f"{k} {med[k]}" for k in keys)
            )
    finally:
        stack.stop(timeout_s=10)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=lambda s: [int(x) for x in s.split(",")], default=[64, 10000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--running", type=int, default=256, help="requests stepped together")
    parser.add_argument("--tokens", type=int, default=200, help="tokens per request")
    parser.add_argument("--host-ms", type=float, default=1.0, help="per step, GIL held")
    parser.add_argument("--gpu-ms", type=float, default=4.0, help="per step, asleep")
    parser.add_argument("--detokenizers", type=int, default=2)
    parser.add_argument("--json", default=None, help="append one JSON line per run")
    asyncio.run(main(parser.parse_args()))
