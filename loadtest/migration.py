"""Request migration under a scheduler's SIGKILL (docs/reliability.md, "Request migration").

Starts the local stack (`kubesgl.launcher.Stack`: nats-server, two scheduler instances, one of each other
service, the demo model on CPU), runs `--streams` concurrent streamed chat completions (half greedy, half seeded
with top_p) once undisturbed, then the same requests again while the busiest scheduler instance is SIGKILLed
once every stream has a few chunks. Prints and returns one JSON summary: streams kept (every text and usage
count identical to the undisturbed run) and lost (an error, or a text or count that differs), how many moved
(the gateway's counter), the gateway's migration time (death declared -> admitted elsewhere, p50/p99), and
per pass each stream's longest pause between chunks and end-to-end time (p50/p99). tests/e2e/test_migration.py runs
the same two passes at 64 streams and asserts nothing is lost.

    .venv/bin/python loadtest/migration.py --streams 256
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from kubesgl.launcher import DEMO, ServiceProcess, Stack, StackConfig, resolve_model

SCHEDULER_ARGS = ("--device", "cpu", "--num-pages", "16384", "--drain-timeout", "10")


def request_body(i: int, max_tokens: int) -> dict[str, Any]:
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.95, "seed": 1000 + i}
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": f"Request {i}: tell me about the number {i * 7}."}],
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


async def stream_one(
    client: httpx.AsyncClient, i: int, max_tokens: int, progress: list[int]
) -> dict[str, Any]:
    """One streamed chat completion: its text, usage, response ids, finish reason, error event, timings."""
    text, ids, usage, finish, error = [], set(), None, None, None
    start = last = time.monotonic()
    gap = 0.0
    async with client.stream("POST", "/v1/chat/completions", json=request_body(i, max_tokens)) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            now = time.monotonic()
            gap, last = max(gap, now - last), now
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]
                continue
            ids.add(event["id"])
            for choice in event.get("choices", []):
                text.append(choice["delta"].get("content") or "")
                finish = choice.get("finish_reason") or finish
                progress[i] += 1
            usage = event.get("usage") or usage
    return {
        "text": "".join(text),
        "ids": ids,
        "usage": usage,
        "finish": finish,
        "error": error,
        "e2e_s": time.monotonic() - start,
        "max_gap_s": gap,
    }


def busiest_scheduler(stack: Stack) -> ServiceProcess:
    def running(svc: ServiceProcess) -> float:
        m = re.search(r"^sglang:num_running_reqs\{[^}]*\} (\S+)$", httpx.get(svc.metrics_url).text, re.M)
        return float(m.group(1)) if m else 0.0

    return max((s for s in stack.services.values() if s.kind == "scheduler"), key=running)


async def run_streams(
    url: str, streams: int, max_tokens: int, kill: Stack | None = None, kill_after_chunks: int = 3
) -> list[dict[str, Any]]:
    """`streams` concurrent streams; with `kill`, its busiest scheduler is SIGKILLed once every stream has
    `kill_after_chunks` chunks (asserting that the streams were then still far from done)."""
    progress = [0] * streams
    limits = httpx.Limits(max_connections=streams + 8)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(stream_one(client, i, max_tokens, progress)) for i in range(streams)]
        if kill is not None:
            while sum(p >= kill_after_chunks for p in progress) < streams and not all(
                t.done() for t in tasks
            ):
                await asyncio.sleep(0.05)
            busiest_scheduler(kill).proc.send_signal(signal.SIGKILL)
            streamed = sum(progress)
        results = await asyncio.gather(*tasks)
    if kill is not None:
        assert streamed < streams * (max_tokens - kill_after_chunks), (
            "the kill came after the streams were done"
        )
    return results


USAGE_COUNTS = ("prompt_tokens", "completion_tokens", "total_tokens")


def differences(undisturbed: list[dict[str, Any]], disturbed: list[dict[str, Any]]) -> list[str]:
    """Why each disturbed stream is not its undisturbed twin (empty when every one is): an error, another text,
    other usage counts (cached_tokens aside: the cache's state differs between the runs), several ids."""
    why = []
    for i, (want, got) in enumerate(zip(undisturbed, disturbed, strict=True)):
        if got.get("error"):
            why.append(f"stream {i}: {got['error']}")
        elif got["text"] != want["text"]:
            why.append(f"stream {i}: text differs")
        elif [got["usage"][k] for k in USAGE_COUNTS] != [want["usage"][k] for k in USAGE_COUNTS]:
            why.append(f"stream {i}: usage {got['usage']} != {want['usage']}")
        elif (got["finish"], len(got["ids"])) != (want["finish"], 1):
            why.append(f"stream {i}: finish {got['finish']}, ids {got['ids']}")
    return why


def migrated_total(stack: Stack) -> float:
    metrics = httpx.get(stack.gateway_urls[0] + "/metrics").text
    m = re.search(r'^kubesgl_requests_migrated_total\{outcome="migrated"\} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def migration_seconds(stack: Stack) -> dict[str, float]:
    """The gateway's migration histogram (death declared -> resumed request admitted): p50/p99 as the upper
    bound of the bucket that holds them."""
    metrics = httpx.get(stack.gateway_urls[0] + "/metrics").text
    buckets = [
        (float(le), float(n))
        for le, n in re.findall(
            r'^kubesgl_request_migration_duration_seconds_bucket\{le="([^"]+)"\} (\S+)$', metrics, re.M
        )
    ]
    total = buckets[-1][1] if buckets else 0.0
    at = lambda q: next((le for le, n in buckets if n >= q * total), float("nan"))  # noqa: E731
    return {"admit_p50_s": at(0.5), "admit_p99_s": at(0.99)} if total else {}


def summarize(
    stack: Stack, undisturbed: list[dict[str, Any]], disturbed: list[dict[str, Any]]
) -> dict[str, Any]:
    """Kept/lost, and what the kill added: the gateway's own migration time, each stream's longest pause
    between chunks and its end-to-end time, disturbed against undisturbed (on a small CPU box the second
    also carries the lost instance's capacity: every stream then runs on the one that is left)."""
    lost = differences(undisturbed, disturbed)
    ok = [r for r in disturbed if not r.get("error")]
    r3 = lambda v: None if v is None else round(v, 3)  # noqa: E731

    def p(rows: list[dict[str, Any]], key: str, q: float) -> float | None:
        return r3(_quantile([r[key] for r in rows], q))

    return {
        "streams": len(disturbed),
        "kept": len(disturbed) - len(lost),
        "lost": len(lost),
        "lost_why": lost[:5],
        "migrated_total": migrated_total(stack),
        **migration_seconds(stack),
        **{
            f"{k.removesuffix('_s')}_{run}_p{q}_s": p(rows, k, q / 100)
            for k in ("max_gap_s", "e2e_s")
            for run, rows in (("calm", undisturbed), ("killed", ok))
            for q in (50, 99)
        },
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=24)
    args = ap.parse_args()
    model, name = resolve_model(DEMO, None)
    config = StackConfig(
        model_path=model, served_model_name=name, schedulers=2, port=0, scheduler_args=SCHEDULER_ARGS
    )
    stack = Stack(config, Path(tempfile.mkdtemp(prefix="kubesgl-migration-")))
    try:
        stack.start()
        stack.wait_ready(300)
        url = stack.gateway_urls[0]
        undisturbed = asyncio.run(run_streams(url, args.streams, args.max_tokens))
        disturbed = asyncio.run(run_streams(url, args.streams, args.max_tokens, kill=stack))
        summary = summarize(stack, undisturbed, disturbed)
    finally:
        stack.stop(timeout_s=10)
    print(json.dumps(summary))
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
