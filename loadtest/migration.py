"""Request migration under a scheduler's SIGKILL (docs/reliability.md, "Request migration").

Starts the local stack (`kubesgl.launcher.Stack`: nats-server, two scheduler instances, one of each other
service, the demo model on CPU), runs `--streams` concurrent streamed chat completions (half greedy, half seeded
with top_p) once undisturbed, then the same requests again while the busiest scheduler instance is SIGKILLed
mid-stream: once every stream has output, the instance whose unfinished streams then lack the most tokens (read
from the instances themselves at that moment, see `kill_busiest`), and only while they are provably far from
done. Prints and returns one JSON summary: streams kept (every text and usage count identical to the undisturbed
run) and lost (an error, or a text or count that differs), how many moved (the gateway's counter), the gateway's
migration time (death declared -> admitted elsewhere, p50/p99), and per pass each stream's longest pause between
chunks and end-to-end time (p50/p99). tests/e2e/test_migration.py runs the same two passes at 64 streams and
asserts nothing is lost.

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import nats
from kubesgl.launcher import DEMO, ServiceProcess, Stack, StackConfig, resolve_model
from kubesgl.protocol import SchedulerStats, stats_subject

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


@dataclass
class Progress:
    """What the client has seen of one stream so far."""

    rid: str | None = None  # its response id: its rid on its scheduler instance too (one choice a request)
    has_output: bool = False  # a chunk with text came
    done: bool = False


async def stream_one(
    client: httpx.AsyncClient, i: int, max_tokens: int, progress: list[Progress]
) -> dict[str, Any]:
    """One streamed chat completion: its text, usage, response ids, finish reason, error event, timings."""
    text, ids, usage, finish, error = [], set(), None, None, None
    seen = progress[i]
    start = last = time.monotonic()
    gap = 0.0
    try:
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
                seen.rid = seen.rid or event["id"]
                for choice in event.get("choices", []):
                    content = choice["delta"].get("content") or ""
                    text.append(content)
                    finish = choice.get("finish_reason") or finish
                    seen.has_output = seen.has_output or bool(content)
                usage = event.get("usage") or usage
    finally:
        seen.done = True
    return {
        "text": "".join(text),
        "ids": ids,
        "usage": usage,
        "finish": finish,
        "error": error,
        "e2e_s": time.monotonic() - start,
        "max_gap_s": gap,
    }


GENERATED = re.compile(r"^sglang:generation_tokens_total\{[^}]*\} (\S+)$", re.M)


def schedulers(stack: Stack) -> list[ServiceProcess]:
    return [s for s in stack.services.values() if s.kind == "scheduler"]


def generated_tokens(metrics: str) -> float:
    """An instance's sglang:generation_tokens_total: every output token its service process has taken from its
    engine, counted as each step's outputs arrive (before they join their streams: runtime/telemetry)."""
    m = GENERATED.search(metrics)
    assert m is not None, "no sglang:generation_tokens_total in a scheduler's /metrics"
    return float(m.group(1))


async def kill_busiest(
    stack: Stack,
    progress: list[Progress],
    generated_before: dict[str, float],
    max_tokens: int,
    min_left: int,
    timeout_s: float,
) -> dict[str, Any]:
    """SIGKILLs the scheduler instance whose unfinished streams are furthest from done, once every stream has
    output, and only once one provably holds streams with tokens left; returns what it knew when it struck.

    What it reads is each instance's own state at that moment, not the client's view (under load an instance's
    deltas coalesce and lag its engine, so chunk counts say little of its progress) nor a gauge refreshed per
    heartbeat (sglang:num_running_reqs, which reads 0 for an instance that has just admitted its streams and
    non-zero for one that has just finished them): first the rids it holds unfinished (its stats reply:
    a stream leaves it only once its final delta is acked, which needs all its tokens), then its generated-token
    counter, which already holds every token those streams have (it counts a step's outputs before they join
    their streams). Every stream runs to `max_tokens` (the undisturbed pass shows it; the disturbed one must
    match it), so the client's streams that the instance holds still lack at least
    `left = max_tokens * held - generated since the pass began` tokens, and one of them at least left / held.
    It strikes only when that is >= `min_left`: that stream's final delta is then still `min_left` engine
    steps away, more than the instant from that read to the signal. Fails after `timeout_s` or once every
    stream is done, saying what it last saw."""
    deadline = time.monotonic() + timeout_s
    scheds = schedulers(stack)
    last: dict[str, Any] = {"every stream has output": False}
    nc = await nats.connect(stack.nats_url)
    try:
        async with httpx.AsyncClient(timeout=30) as http:

            async def state(svc: ServiceProcess, ours: set[str]) -> tuple[int, float]:
                reply = await nc.request(stats_subject(str(svc.instance_id)), b"", timeout=30)
                held = len(ours.intersection(SchedulerStats.from_bytes(reply.data).active_rids))
                generated = generated_tokens((await http.get(svc.metrics_url)).text)
                return held, max_tokens * held - (generated - generated_before[svc.name])

            while True:
                if all(p.done for p in progress):
                    raise AssertionError(f"every stream ended before the kill; last seen: {last}")
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"no scheduler instance held streams with >= {min_left} tokens left within "
                        f"{timeout_s:g} s; last seen: {last}"
                    )
                if all(p.has_output or p.done for p in progress):
                    ours = {p.rid for p in progress if p.rid is not None and not p.done}
                    states = await asyncio.gather(*(state(svc, ours) for svc in scheds))
                    (held, left), victim = max(zip(states, scheds, strict=True), key=lambda x: x[0][1])
                    last = {
                        svc.name: {"held": h, "tokens_left": t}
                        for (h, t), svc in zip(states, scheds, strict=True)
                    }
                    if held and left >= min_left * held:
                        victim.proc.send_signal(signal.SIGKILL)
                        return {"victim": victim.name, "held": held, "tokens_left": left, "seen": last}
                await asyncio.sleep(0.05)
    finally:
        await nc.close()


async def run_streams(
    url: str,
    streams: int,
    max_tokens: int,
    kill: Stack | None = None,
    kill_timeout_s: float = 60.0,
) -> list[dict[str, Any]]:
    """`streams` concurrent streams; with `kill`, its busiest scheduler is SIGKILLed mid-stream (kill_busiest:
    once every stream has output, while that instance holds streams with a quarter of `max_tokens` left)."""
    progress = [Progress() for _ in range(streams)]
    limits = httpx.Limits(max_connections=streams + 8)
    if kill is not None:
        before = {s.name: generated_tokens(httpx.get(s.metrics_url).text) for s in schedulers(kill)}
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        tasks = [asyncio.create_task(stream_one(client, i, max_tokens, progress)) for i in range(streams)]
        try:
            if kill is not None:
                min_left = max(1, max_tokens // 4)
                struck = await kill_busiest(kill, progress, before, max_tokens, min_left, kill_timeout_s)
                print(f"SIGKILLed {json.dumps(struck)}", file=sys.stderr)
            results = await asyncio.gather(*tasks)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
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
        disturbed = asyncio.run(
            run_streams(url, args.streams, args.max_tokens, kill=stack, kill_timeout_s=300)
        )
        summary = summarize(stack, undisturbed, disturbed)
    finally:
        stack.stop(timeout_s=10)
    print(json.dumps(summary))
    return 0 if summary["lost"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
