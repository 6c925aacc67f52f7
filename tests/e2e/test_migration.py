"""Request migration, the done-when of issue 27: two scheduler instances, 64 concurrent streams (greedy and
seeded), one instance SIGKILLed mid-stream. Every stream completes, its text and usage identical to an
undisturbed run of the same requests, its chunks under one id; the gateway counts the migrations."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import time
from pathlib import Path

import httpx
import pytest
from kubesgl.launcher import ServiceProcess, Stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STREAMS = 64
MAX_TOKENS = 16


def _body(i: int) -> dict:
    sampling = {"temperature": 0} if i % 2 == 0 else {"temperature": 1.0, "top_p": 0.95, "seed": 1000 + i}
    return {
        "model": "demo",
        "messages": [{"role": "user", "content": f"Request {i}: tell me about the number {i * 7}."}],
        "max_tokens": MAX_TOKENS,
        "stream": True,
        "stream_options": {"include_usage": True},
        **sampling,
    }


async def _stream(client: httpx.AsyncClient, i: int, progress: list[int]) -> dict:
    """One streamed chat completion: its text, usage, ids seen, finish reason, and any error event."""
    text, ids, usage, finish, error = [], set(), None, None, None
    async with client.stream("POST", "/v1/chat/completions", json=_body(i)) as resp:
        if resp.status_code != 200:
            return {"error": f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
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
    return {"text": "".join(text), "ids": ids, "usage": usage, "finish": finish, "error": error}


async def _run(url: str, kill: Stack | None = None) -> list[dict]:
    progress = [0] * STREAMS
    limits = httpx.Limits(max_connections=STREAMS + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(_stream(client, i, progress)) for i in range(STREAMS)]
        if kill is not None:
            # Mid-stream: every stream has some of its text, none has all of it.
            while sum(p >= 3 for p in progress) < STREAMS:
                await asyncio.sleep(0.05)
            _busiest_scheduler(kill).proc.send_signal(signal.SIGKILL)
            streamed = sum(progress)
        results = await asyncio.gather(*tasks)
    if kill is not None:
        assert streamed < STREAMS * (MAX_TOKENS - 3), "the kill came after the streams were mostly done"
    return results


def _busiest_scheduler(stack: Stack) -> ServiceProcess:
    def running(svc: ServiceProcess) -> float:
        m = re.search(r"^sglang:num_running_reqs\{[^}]*\} (\S+)$", httpx.get(svc.metrics_url).text, re.M)
        return float(m.group(1)) if m else 0.0

    return max((s for s in stack.services.values() if s.kind == "scheduler"), key=running)


def _migrated(stack: Stack) -> float:
    metrics = httpx.get(stack.gateway_urls[0] + "/metrics").text
    m = re.search(r'^kubesgl_requests_migrated_total\{outcome="migrated"\} (\S+)$', metrics, re.M)
    return float(m.group(1)) if m else 0.0


def test_streams_survive_the_sigkill_of_their_scheduler(stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    s: Stack = stack(schedulers=2)
    url = s.gateway_urls[0]
    t0 = time.monotonic()
    undisturbed = asyncio.run(_run(url))
    t1 = time.monotonic()
    assert all(r["error"] is None for r in undisturbed), [r["error"] for r in undisturbed if r["error"]]
    disturbed = asyncio.run(_run(url, kill=s))
    print(f"undisturbed run {t1 - t0:.1f} s, disturbed run {time.monotonic() - t1:.1f} s")
    failed = [(i, r["error"]) for i, r in enumerate(disturbed) if r.get("error")]
    assert failed == [], f"{len(failed)} streams failed: {failed[:3]}"
    for i, (want, got) in enumerate(zip(undisturbed, disturbed, strict=True)):
        assert got["text"] == want["text"], f"stream {i}"
        # Counted once: the resumed tokens are neither lost nor counted twice (cached_tokens is the cache's
        # state, which differs between the runs).
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        assert [got["usage"][k] for k in counts] == [want["usage"][k] for k in counts], f"stream {i}"
        assert got["usage"]["completion_tokens"] == MAX_TOKENS
        assert (got["finish"], len(got["ids"])) == ("length", 1), f"stream {i}"
    migrated = _migrated(s)
    print(f"{migrated:.0f} streams migrated")
    assert migrated >= 1, "no stream was migrated: the kill hit nothing"
