"""The serving path at GPU pace, stage by stage (prints figures, asserts nothing).

The real gateway, nats-server, tokenizer and detokenizer (kubesgl.launcher's processes) and the real scheduler
service with its real EngineLoop thread, whose Engine is replaced by a FAKE (FakeEngine below: the GPU math is
what this is not about). Each fake step sleeps `--step-ms` (the GIL free, as during a forward pass) plus its
prefill at `--prefill-tok-s`, then gives every running request one token. The fake alone, driven in this
process with no service around it, is the path's ceiling: "engine tok/s".

Clients stream /v1/completions through kubesgl.bench.sse_client, all at once. Every `--trace-every`-th request
carries a sampled W3C traceparent (the others an unsampled one, so tracing costs only the traced), and the
services' spans, received by a local OTLP endpoint (tests/support/otlp_receiver.py), give each traced request's stages:
client send -> gateway arrival (ASGI entry) -> tokenizer -> scheduler arrival -> the start of the engine step
that produced the first token -> first token out of the engine -> detokenized -> first SSE byte (the gateway
span's TTFT) -> the client's first chunk. Also each process's CPU time per output token (psutil), which on a
machine with a core per service says which one caps the path.

    .venv/bin/python benchmark/serve_path.py [--streams 64,256] [--step-ms 10] [--json out.jsonl]

With `--model DIR --scheduler-args "..."` the real scheduler (`kubesgl scheduler`, engine and all) replaces the
fake: the same stages at a real engine's pace, on the GPU (`device_run.sh servetrace`).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import random
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
from kubesgl.bench.serve import burst_hook
from kubesgl.bench.sse_client import post_events
from kubesgl.bench.timing import percentile
from kubesgl.launcher import Stack, StackConfig, free_port, resolve_model
from kubesgl.values.outputs import EngineStats, FinishReason, ModelInfo, RequestOutput
from kubesgl.values.sampling import SamplingParams

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from support.otlp_receiver import OtlpReceiver, ReceivedSpan  # noqa: E402

PAGES = 1_000_000
INSTANCE = "fake-scheduler-0"
STAGES = (
    ("client send", "client", "arrival"),
    ("parse + hop to tokenizer", "arrival", "tokenizer"),
    ("tokenize + route + hop", "tokenizer", "scheduler"),
    ("queue at the scheduler", "scheduler", "prefill_start"),
    ("prefill step", "prefill_start", "first_token"),
    ("to detokenizer + decode", "first_token", "detokenized"),
    ("gateway: delta to SSE byte", "detokenized", "sse"),
    ("loopback + client read", "sse", "client_first"),
)


class FakeEngine:
    """A FAKE engine: the Engine's interface, no model. Each step admits waiting requests (at most
    `max_running` running, `chunk` prompt tokens prefilled per step), sleeps step_ms + prefill time, and gives
    every running request one token (ids that decode to text). `busy_ms` of each step is a Python loop holding
    the GIL (the real engine's host work: scheduling, batch building, launches), the rest sleeps."""

    def __init__(
        self, step_ms: float, prefill_tok_s: float, max_running: int, chunk: int = 8192, busy_ms: float = 0.0
    ) -> None:
        self.info = ModelInfo("fake", "Qwen3ForCausalLM", 40960, 151936, (151645,), 16, PAGES)
        self.cache = None
        self.kv_events = None
        self._step_s, self._prefill_tok_s = step_ms / 1000, prefill_tok_s
        self._busy_s = min(busy_ms, step_ms) / 1000
        self._max_running, self._chunk = max_running, chunk
        self._waiting: deque[tuple[str, int, int]] = deque()  # rid, prompt tokens, max tokens
        self._running: dict[str, list[int]] = {}  # rid -> [emitted, max tokens, prompt tokens]

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams, output_ids=()) -> None:
        self._waiting.append((rid, len(input_ids), params.max_tokens or 16))

    def abort(self, rid: str) -> None:
        self._running.pop(rid, None)
        self._waiting = deque(w for w in self._waiting if w[0] != rid)

    def has_work(self) -> bool:
        return bool(self._running or self._waiting)

    def step(self) -> list[RequestOutput]:
        prefill = 0
        while self._waiting and len(self._running) < self._max_running and prefill < self._chunk:
            rid, prompt, max_tokens = self._waiting.popleft()
            self._running[rid] = [0, max_tokens, prompt]
            prefill += prompt
        until = time.perf_counter() + self._busy_s
        while time.perf_counter() < until:  # holds the GIL, as the engine's host work does
            pass
        time.sleep(self._step_s - self._busy_s + prefill / self._prefill_tok_s)
        outputs = []
        for rid, r in list(self._running.items()):
            r[0] += 1
            done = r[0] >= r[1]
            token = 1000 + (r[0] * 7919 + len(rid)) % 5000
            outputs.append(
                RequestOutput(rid, [token], r[2], 0, r[0], done, FinishReason.LENGTH if done else None)
            )
            if done:
                del self._running[rid]
        return outputs

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        return [], []

    def stats(self) -> EngineStats:
        n = len(self._running)
        return EngineStats(n, len(self._waiting), PAGES, PAGES, PAGES, 0)

    def shutdown(self) -> None:
        pass


def fake_engine_alone(
    args: argparse.Namespace, prompts: list[int], outputs: list[int]
) -> tuple[float, list[float]]:
    """The fake alone on the workload, no services, every request added at once (the path's streams all start
    together): output tok/s (the path's ceiling) and each request's time to its first token."""
    engine = FakeEngine(args.step_ms, args.prefill_tok_s, args.max_running, busy_ms=args.step_busy_ms)
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(f"r{i}", [0] * p, SamplingParams(max_tokens=n))
    start, tokens, firsts = time.perf_counter(), 0, {}
    while engine.has_work():
        outs = engine.step()
        now = time.perf_counter() - start
        for out in outs:
            firsts.setdefault(out.rid, now)
        tokens += len(outs)
    return tokens / (time.perf_counter() - start), list(firsts.values())


def run_fake_scheduler(args: argparse.Namespace) -> int:
    """The scheduler process: the real SchedulerService and EngineLoop over FakeEngine."""
    from kubesgl.runtime.bus_service import run_bus_service
    from kubesgl.runtime.telemetry.metrics import SchedulerMetrics, new_registry
    from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
    from kubesgl.runtime.telemetry.tracing import Tracing
    from kubesgl.services.scheduler.engine_loop import EngineLoop
    from kubesgl.services.scheduler.engine_process import EngineProcess
    from kubesgl.services.scheduler.service import SchedulerService

    registry, tracing = new_registry(), Tracing("kubesgl-scheduler")

    def telemetry(info: ModelInfo) -> SchedulerTelemetry:
        metrics = SchedulerMetrics(registry, "demo", info.page_size, info.num_pages)
        return SchedulerTelemetry(metrics, tracing, INSTANCE, "demo")

    async def build(nc: Any, stop: asyncio.Event) -> SchedulerService:
        def loop(service: SchedulerService) -> EngineLoop | EngineProcess:
            # picklable, for the engine process (spawn imports this script as __mp_main__)
            make = functools.partial(
                FakeEngine, args.step_ms, args.prefill_tok_s, args.max_running, busy_ms=args.step_busy_ms
            )
            callbacks = (service.engine_loaded, service.engine_outputs, service.engine_failed)
            if args.engine_process:
                return EngineProcess(make, telemetry, *callbacks, service.engine_kv_events, args.log_level)
            return EngineLoop(make, telemetry, *callbacks, service.engine_kv_events)

        return SchedulerService(
            nc,
            INSTANCE,
            "demo",
            args.max_running,
            4096,
            loop,
            stop,
            stream_interval=args.stream_interval,
            **({"detok_batch_size": args.detok_batch_size} if args.detok_batch_size else {}),
        )

    try:
        return run_bus_service(args, INSTANCE, registry, build)
    finally:
        tracing.shutdown()


@dataclass
class Result:
    client_ns: int
    first_s: float | None = None
    tokens: int = 0
    chunks: int = 0  # SSE events with a choice (fewer than tokens where the gateway coalesced queued ones)
    trace_id: str | None = None
    error: str | None = None


async def drive(url: str, prompts: list[list[int]], outputs: list[int], trace_every: int) -> list[Result]:
    async def one(i: int, ids: list[int], n: int) -> Result:
        traced = i % trace_every == 0
        trace_id = secrets.token_hex(16)
        parent = f"00-{trace_id}-{secrets.token_hex(8)}-{'01' if traced else '00'}"
        body = {"model": "demo", "prompt": ids, "max_tokens": n, "ignore_eos": True, "stream": True}
        body["stream_options"] = {"include_usage": True}  # a chunk may carry several tokens: count from usage
        res = Result(time.time_ns(), trace_id=trace_id if traced else None)
        start = time.perf_counter()
        try:
            async for data in post_events(url, "/v1/completions", body, {"traceparent": parent}):
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"])
                    break
                if res.first_s is None and any(c.get("text") for c in event["choices"]):
                    res.first_s = time.perf_counter() - start
                res.chunks += len(event["choices"])
                if event.get("usage"):
                    res.tokens = event["usage"]["completion_tokens"]
        except Exception as e:  # a benchmark counts failures, it does not stop at one
            res.error = f"{type(e).__name__}: {e}"
        return res

    return list(
        await asyncio.gather(*(one(i, p, n) for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))))
    )


def stages(res: Result, spans: list[ReceivedSpan]) -> dict[str, float] | None:
    """The stage boundaries of one traced request (unix ns), from its spans; None if any is missing."""
    mine = [s for s in spans if s.trace_id == res.trace_id]
    by_name = {s.name: s for s in mine if s.name != "detokenize"}
    first_detok = [s for s in mine if s.name == "detokenize" and s.attributes.get("kubesgl.seq") == 0]
    needed = ("gateway request", "tokenize", "queue", "prefill")
    if any(n not in by_name for n in needed) or not first_detok or res.first_s is None:
        return None
    gateway = by_name["gateway request"]
    ttft = gateway.attributes.get("kubesgl.ttft_s")
    if ttft is None:
        return None
    return {
        "client": res.client_ns,
        "arrival": gateway.start_ns,
        "tokenizer": by_name["tokenize"].start_ns,
        "scheduler": by_name["queue"].start_ns,
        "prefill_start": by_name["prefill"].start_ns,  # the step that produced the first token
        "first_token": by_name["prefill"].end_ns,
        "detokenized": first_detok[0].end_ns,
        "sse": gateway.start_ns + int(ttft * 1e9),
        "client_first": res.client_ns + int(res.first_s * 1e9),
    }


def _timeline(traced: list[dict[str, float]]) -> dict[str, list[float]]:
    if not traced:
        return {}
    t0 = min(s["arrival"] for s in traced)
    out = {}
    for key in ("arrival", "tokenizer", "scheduler", "prefill_start", "first_token"):
        ms = sorted((s[key] - t0) / 1e6 for s in traced)
        out[key] = [round(ms[0], 1), round(statistics.median(ms), 1), round(ms[-1], 1)]
    return out


def gateway_ttft(url: str) -> tuple[float, float]:
    """(sum, count) of the gateway's TTFT histogram for the demo model."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    values = {"sum": 0.0, "count": 0.0}
    for line in text.splitlines():
        for key in values:
            if line.startswith(f'kubesgl_gateway_time_to_first_token_seconds_{key}{{model="demo"}} '):
                values[key] = float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


def cpu_seconds(procs: dict[str, psutil.Process]) -> dict[str, float]:
    """Each process's CPU time, its live children's included (a gateway's --workers)."""
    out = {}
    for name, proc in procs.items():
        family = [proc, *(proc.children(recursive=True) if name.startswith("gateway") else [])]
        out[name] = sum(sum(p.cpu_times()[:2]) for p in family)
    return out


async def run_once(
    stack: Stack,
    procs: dict[str, psutil.Process],
    receiver: OtlpReceiver,
    args: argparse.Namespace,
    n: int,
    seed: int,
) -> dict[str, Any]:
    rng = random.Random(seed)  # each run its own prompts: a later run meets the cache the earlier ones left
    lens = [rng.randint(args.min_input, args.max_input) for _ in range(n)]
    prompts = [[rng.randint(100, 10000) for _ in range(k)] for k in lens]
    outputs = [rng.randint(args.min_output, args.max_output) for _ in range(n)]
    url = stack.gateway_urls[0]
    await drive(url, prompts[:2], [4, 4], 10**9)  # warm-up
    receiver.snapshot()
    ttft0 = gateway_ttft(url)
    hook_failed = ["start"] if await burst_hook(args.burst_hook, "start") else []
    cpu0 = cpu_seconds(procs)
    start = time.perf_counter()
    results = await drive(url, prompts, outputs, args.trace_every)
    wall = time.perf_counter() - start
    cpu = {k: v - cpu0[k] for k, v in cpu_seconds(procs).items()}
    hook_failed += ["end"] if await burst_hook(args.burst_hook, "end") else []
    ttft1 = gateway_ttft(url)
    await asyncio.sleep(1.5)  # the services' span batches (OTEL_BSP_SCHEDULE_DELAY) arrive
    spans = receiver.snapshot()
    ok = [r for r in results if r.error is None]
    tokens = sum(r.tokens for r in ok)
    firsts = [r.first_s for r in ok if r.first_s is not None]
    traced = [s for r in ok if r.trace_id and (s := stages(r, spans)) is not None]
    # The fake alone is the ceiling; with a real model (--model) the offline engine is `kubesgl bench serve`'s.
    engine_tok_s, engine_firsts = fake_engine_alone(args, lens, outputs) if not args.model else (None, [])
    row: dict[str, Any] = {
        "streams": n,
        "step_ms": args.step_ms,
        "step_busy_ms": args.step_busy_ms,
        "stream_interval": args.stream_interval,
        "detok_batch_size": args.detok_batch_size,
        "gateway_workers": args.gateway_workers,
        "failed": len(results) - len(ok),
        "burst_hook_failed": hook_failed,
        "errors": sorted({r.error for r in results if r.error})[:3],
        "output_tokens": tokens,
        "tokens_per_chunk": round(tokens / max(sum(r.chunks for r in ok), 1), 3),
        "seconds": round(wall, 3),
        "path_tok_s": round(tokens / wall),
        "model": args.model or "fake",
        "engine_tok_s": round(engine_tok_s) if engine_tok_s is not None else None,
        "client_ttft_mean_ms": round(1000 * statistics.mean(firsts), 1) if firsts else None,
        "client_ttft_p99_ms": round(1000 * percentile(firsts, 99), 1) if firsts else None,
        # The fake engine's own TTFT for the same arrival (all at once): what the path's p99 is judged against.
        "engine_ttft_mean_ms": round(1000 * statistics.mean(engine_firsts), 1) if engine_firsts else None,
        "engine_ttft_p99_ms": round(1000 * percentile(engine_firsts, 99), 1) if engine_firsts else None,
        # The gateway's own TTFT histogram over the burst (/metrics before and after).
        "gateway_ttft_mean_ms": round(1000 * (ttft1[0] - ttft0[0]) / (ttft1[1] - ttft0[1]), 1)
        if ttft1[1] > ttft0[1]
        else None,
        "traced": len(traced),
        "stage_ms_mean": {
            name: round(statistics.mean((s[b] - s[a]) / 1e6 for s in traced), 2) for name, a, b in STAGES
        }
        if traced
        else {},
        # When the burst's traced requests passed each boundary, ms after the first one reached a gateway:
        # [first, median, last]. A hop that holds a burst's requests until it has handled them all shows a
        # first crossing near the stage before's last.
        "timeline_ms": _timeline(traced),
        "cpu_us_per_token": {k: round(1e6 * v / max(tokens, 1), 1) for k, v in sorted(cpu.items())},
    }
    row["path_over_engine"] = (
        round(row["path_tok_s"] / row["engine_tok_s"], 3) if row["engine_tok_s"] else None
    )
    if row["client_ttft_p99_ms"] is not None and row["engine_ttft_p99_ms"]:
        row["ttft_p99_over_engine"] = round(row["client_ttft_p99_ms"] / row["engine_ttft_p99_ms"], 3)
    return row


def print_row(row: dict[str, Any]) -> None:
    fake = row["model"] == "fake"
    alone = f", fake engine alone {row['engine_tok_s']} ({row['path_over_engine']})" if fake else ""
    print(
        f"\n{row['streams']} streams ({row['model']}): {row['path_tok_s']} tok/s through the path{alone}; "
        f"failed {row['failed']}; client / gateway TTFT mean {row['client_ttft_mean_ms']} / "
        f"{row['gateway_ttft_mean_ms']} ms; {row['tokens_per_chunk']} tokens per SSE chunk"
    )
    print(
        f"  TTFT mean / p99: client {row['client_ttft_mean_ms']} / {row['client_ttft_p99_ms']} ms"
        + (
            f", fake engine alone (same arrival) {row['engine_ttft_mean_ms']} / {row['engine_ttft_p99_ms']} ms; "
            f"p99 ratio {row.get('ttft_p99_over_engine')}"
            if fake
            else ""
        )
    )
    for error in row["errors"]:
        print(f"  error: {error}")
    print(f"  stages, mean over {row['traced']} traced requests (ms):")
    for name, ms in row["stage_ms_mean"].items():
        print(f"    {name:<28} {ms:>9}")
    if row["timeline_ms"]:
        print(
            "  traced requests at each boundary, ms after the first reached a gateway: first / median / last"
        )
        for name, (a, b, c) in row["timeline_ms"].items():
            print(f"    {name:<28} {a:>9} {b:>9} {c:>9}")
    print("  CPU per output token (us): " + ", ".join(f"{k} {v}" for k, v in row["cpu_us_per_token"].items()))


async def main(args: argparse.Namespace) -> None:
    model, _ = resolve_model(args.model or "demo", None)
    with OtlpReceiver() as receiver:
        env = {
            "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "200",
            "OTEL_BSP_MAX_QUEUE_SIZE": "65536",
        }
        config = StackConfig(
            model_path=model,
            served_model_name="demo",  # what the clients ask for and the metrics are labelled with, either way
            port=0,
            schedulers=1 if args.model else 0,  # --model: the real scheduler, as `kubesgl up` starts it
            # --model: the real scheduler gets the flags the fake scheduler would have taken, then its own
            scheduler_args=(
                "--stream-interval",
                str(args.stream_interval),
                *_detok_batch_flag(args),
                "--max-running-requests",
                str(args.max_running),
                "--engine-process" if args.engine_process else "--no-engine-process",
                *shlex.split(args.scheduler_args),
            ),
            detokenizers=args.detokenizers,
            tokenizers=args.tokenizers,
            gateway_workers=args.gateway_workers,
            log_level="warning",
            env=env,
        )
        stack = Stack(config, tempfile.mkdtemp(prefix="serve-path-"))
        stack.start()
        scheduler = None
        if not args.model:
            admin = free_port()
            scheduler = subprocess.Popen(
                [sys.executable, __file__, "--fake-scheduler", "--nats-url", stack.nats_url, "--admin-port",
                 str(admin), "--admin-host", "127.0.0.1", "--log-level", "warning", "--step-ms", str(args.step_ms),
                 "--prefill-tok-s", str(args.prefill_tok_s), "--max-running", str(args.max_running),
                 "--step-busy-ms", str(args.step_busy_ms),
                 "--stream-interval", str(args.stream_interval), *_detok_batch_flag(args),
                 "--engine-process" if args.engine_process else "--no-engine-process"],
                env={**os.environ, **env},
            )  # fmt: skip
        try:
            await asyncio.to_thread(stack.wait_ready, args.ready_timeout)
            procs = {svc.name: psutil.Process(svc.proc.pid) for svc in stack.services.values()}
            engine_name = "scheduler (fake engine)" if scheduler is not None else "scheduler-0"
            if scheduler is not None:
                procs[engine_name] = psutil.Process(scheduler.pid)
            assert stack.nats.proc is not None
            procs["nats-server"] = psutil.Process(stack.nats.proc.pid)
            procs["client"] = psutil.Process()
            while True:  # ready once the gateway has heard the scheduler's heartbeat
                try:
                    await drive(stack.gateway_urls[0], [[101, 102]], [2], 1)
                    break
                except Exception:
                    await asyncio.sleep(0.5)
            for child in procs[engine_name].children():  # --engine-process: the engine's own
                if "resource_tracker" not in " ".join(child.cmdline()):
                    procs["scheduler engine process"] = child
            for i, n in enumerate(args.streams):
                row = await run_once(stack, procs, receiver, args, n, args.seed + i)
                print_row(row)
                if args.json:
                    with open(args.json, "a") as f:
                        f.write(json.dumps(row) + "\n")
        finally:
            if scheduler is not None:
                scheduler.terminate()
                scheduler.wait(10)
            stack.stop(timeout_s=10)


def _detok_batch_flag(args: argparse.Namespace) -> list[str]:
    """The scheduler's --detok-batch-size where one was given; else it keeps its own default."""
    return ["--detok-batch-size", str(args.detok_batch_size)] if args.detok_batch_size else []


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=lambda s: [int(x) for x in s.split(",")], default=[64, 256])
    parser.add_argument("--step-ms", type=float, default=10.0, help="fake decode step (the GPU's pace)")
    parser.add_argument(
        "--step-busy-ms", type=float, default=0.0, help="of each fake step, ms spent holding the GIL"
    )
    parser.add_argument("--prefill-tok-s", type=float, default=200_000.0, help="fake prefill speed")
    parser.add_argument("--max-running", type=int, default=256)
    parser.add_argument("--min-input", type=int, default=100)
    parser.add_argument("--max-input", type=int, default=1024)
    parser.add_argument("--min-output", type=int, default=64)
    parser.add_argument("--max-output", type=int, default=128)
    parser.add_argument("--stream-interval", type=int, default=1, help="the scheduler's --stream-interval")
    parser.add_argument(
        "--detok-batch-size",
        type=int,
        default=None,
        help="the scheduler's --detok-batch-size (default: its own)",
    )
    parser.add_argument("--gateway-workers", type=int, default=1, help="the gateway's --workers")
    parser.add_argument("--trace-every", type=int, default=8, help="every k-th request is traced")
    parser.add_argument(
        "--burst-hook",
        help="a shell command run right before each burst and right after it (BURST_PHASE=start|end), as "
        "`kubesgl bench serve --burst-hook`'s: e.g. a profiler attached over the burst alone",
    )
    parser.add_argument(
        "--model",
        default=None,
        help="a real model dir: the real scheduler (`kubesgl scheduler`) instead of the fake, e.g. on the GPU",
    )
    parser.add_argument("--scheduler-args", default="", help="with --model: the scheduler's flags")
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument("--tokenizers", type=int, default=1)
    parser.add_argument(
        "--ready-timeout", type=float, default=120.0, help="seconds for the stack to be ready"
    )
    parser.add_argument("--json", default=None, help="append one JSON line per run")
    parser.add_argument("--seed", type=int, default=0, help="the first run's prompts; run i gets seed + i")
    parser.add_argument(
        "--engine-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the scheduler's --engine-process: the engine (fake or --model) in a process of its own, apart from the bus work",
    )
    parser.add_argument("--fake-scheduler", action="store_true", help=argparse.SUPPRESS)
    known, rest = parser.parse_known_args()
    if known.fake_scheduler:
        from kubesgl.runtime.bus_service import add_service_arguments

        add_service_arguments(parser, drain_timeout_s=5.0)
        return parser.parse_args()
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    fake_only = [f"--{name.replace('_', '-')}" for name in ("step_ms", "step_busy_ms", "prefill_tok_s")
                 if getattr(known, name) != parser.get_default(name)]  # fmt: skip
    if known.model and fake_only:
        parser.error(f"{', '.join(fake_only)} set the fake engine's pace; --model runs a real one")
    if known.scheduler_args and not known.model:
        parser.error("--scheduler-args is for the real scheduler (--model); the fake takes --step-ms etc.")
    return known


if __name__ == "__main__":
    parsed = parse_args()
    if parsed.fake_scheduler:
        sys.exit(run_fake_scheduler(parsed))
    asyncio.run(main(parsed))
