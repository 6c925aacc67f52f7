"""Deadlines hold on a live stack: `X-Request-Timeout` (and the gateway's `--request-timeout`) is answered with
a 504 / SSE timeout event within 0.5 s of the deadline in every phase a request can be in — streaming tokens,
queued behind a running request in the scheduler, waiting for an admission that does not come (a stalled
tokenizer), and with no tokenizer at all — streaming or not; and the request's pages are freed by the
gateway's abort, not by the scheduler's own expiry seconds later.

The 0.5 s budget is the product's requirement and is asserted as such; the measured lateness is printed
(`-s`) so a slow box shows how much of the budget its own scheduling took."""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import nats
import pytest
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from kubesgl.launcher import ServiceProcess, Stack
from kubesgl.protocol import SchedulerStats, stats_subject

MODEL = "demo"
BUDGET_S = 0.5  # issue 15: answered within 0.5 s of the deadline
# Long enough that admission (tokenize + schedule) surely happens before the deadline on a busy 2-core box,
# so the phase under test is the one the deadline strikes in.
TIMEOUT_S = 2.0
# Pages must be back well before the scheduler's own expiry (deadline + 2 s grace, checked every 1 s):
# then it was the gateway's abort that freed them.
FREED_WITHIN_S = 1.5


@pytest.fixture(scope="module")
def mesh(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # One running request at a time, so a second one is provably queued behind it.
    stack = stack_factory(
        tmp_path_factory.mktemp("deadlines"),
        scheduler_args=(*TEST_SCHEDULER_ARGS, "--max-running-requests", "1"),
    )
    yield stack
    stack.stop(timeout_s=10)


@pytest.fixture(scope="module")
def baseline(mesh: Stack) -> int:
    return asyncio.run(_stats(mesh)).available_pages


def _scheduler(stack: Stack) -> ServiceProcess:
    return next(s for s in stack.services.values() if s.kind == "scheduler")


def _live_tokenizer(stack: Stack) -> ServiceProcess:
    return next(s for s in stack.services.values() if s.kind == "tokenizer" and s.proc.poll() is None)


async def _stats(stack: Stack) -> SchedulerStats:
    nc = await nats.connect(stack.nats_url)
    try:
        msg = await nc.request(stats_subject(str(_scheduler(stack).instance_id)), b"", timeout=10)
        return SchedulerStats.from_bytes(msg.data)
    finally:
        await nc.close()


async def _assert_freed(stack: Stack, baseline: int, since: float) -> None:
    """Running, queued, active rids and available pages back to where they were, within FREED_WITHIN_S."""
    while True:
        s = await _stats(stack)
        settled = (s.running, s.queued, s.active_rids, s.available_pages) == (0, 0, [], baseline)
        if settled:
            return
        assert time.monotonic() - since < FREED_WITHIN_S, f"not freed after the deadline: {s}"
        await asyncio.sleep(0.05)


async def _seen(
    stack: Stack, task: asyncio.Task[Any], phase: Callable[[SchedulerStats], bool]
) -> SchedulerStats:
    """Polls the scheduler until `phase` holds (the request reached the phase under test) or the answer came;
    returns the last stats seen."""
    while True:
        s = await _stats(stack)
        if phase(s) or task.done():
            return s
        await asyncio.sleep(0.05)


@dataclass
class Answer:
    elapsed: float  # seconds from sending to the timeout answer (504 body or SSE timeout event)
    status: int
    error: dict[str, Any]
    chunks_before: int  # content chunks streamed before the timeout event


def _body(stream: bool, max_tokens: int = 20000) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "count to a million"}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": stream,
    }


async def _timed(http: httpx.AsyncClient, stream: bool, timeout_s: float | None = TIMEOUT_S) -> Answer:
    hdrs = {} if timeout_s is None else {"X-Request-Timeout": str(timeout_s)}
    started = time.monotonic()
    if not stream:
        r = await http.post("/v1/chat/completions", json=_body(False), headers=hdrs)
        return Answer(time.monotonic() - started, r.status_code, r.json().get("error", {}), 0)
    chunks = 0
    async with http.stream("POST", "/v1/chat/completions", json=_body(True), headers=hdrs) as r:
        if r.status_code != 200:
            await r.aread()
            return Answer(time.monotonic() - started, r.status_code, r.json().get("error", {}), 0)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return Answer(time.monotonic() - started, 200, event["error"], chunks)
            chunks += 1
    raise AssertionError("the stream ended without a timeout event")


def _check(answer: Answer, timeout_s: float, phase: str) -> None:
    late = answer.elapsed - timeout_s
    print(f"\n{phase}: answered {late * 1000:+.0f} ms after the deadline")
    assert answer.error.get("type") == "timeout", answer
    assert answer.elapsed >= timeout_s, f"answered before the deadline: {answer}"
    assert late <= BUDGET_S, f"{phase}: answered {late:.2f} s after the deadline (budget {BUDGET_S} s)"


@pytest.fixture
async def http(mesh: Stack) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=mesh.gateway_urls[0], timeout=30) as client:
        await client.get("/health")  # the connection is open before any timing starts
        yield client


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_deadline_mid_stream(mesh, baseline, http, stream) -> None:
    task = asyncio.create_task(_timed(http, stream))
    during = await _seen(mesh, task, lambda s: s.running == 1)
    answer = await task
    ended = time.monotonic()
    assert during.running == 1, f"the request was not generating: {during}"
    if stream:
        assert answer.chunks_before > 0, "no tokens streamed before the deadline"
    _check(answer, TIMEOUT_S, f"mid-stream ({'sse' if stream else 'json'})")
    assert answer.status == (200 if stream else 504)
    await _assert_freed(mesh, baseline, ended)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_deadline_while_queued_behind_a_running_request(mesh, baseline, http, stream) -> None:
    async with (
        httpx.AsyncClient(base_url=mesh.gateway_urls[0], timeout=60) as other,
        other.stream("POST", "/v1/chat/completions", json=_body(True)) as blocker,
    ):
        assert blocker.status_code == 200
        # Held in a name: a line iterator dropped after `break` is closed, and with it the blocker's stream.
        lines = blocker.aiter_lines()
        async for line in lines:
            if line.startswith("data: "):
                break  # it runs: the one slot is taken
        task = asyncio.create_task(_timed(http, stream))
        during = await _seen(mesh, task, lambda s: s.queued == 1)
        answer = await task
        ended = time.monotonic()
        assert not blocker.is_closed, "the blocker left early: the request was not queued behind it"
    # Leaving the blocker's stream disconnects it; the gateway aborts it too.
    assert (during.running, during.queued) == (1, 1), f"the request was not queued: {during}"
    _check(answer, TIMEOUT_S, f"queued ({'sse' if stream else 'json'})")
    await _assert_freed(mesh, baseline, ended)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_deadline_while_admission_stalls(mesh, baseline, http, stream) -> None:
    """The only tokenizer is frozen (SIGSTOP): the request is sent to it and no admission ever comes."""
    tokenizer = _live_tokenizer(mesh)
    tokenizer.proc.send_signal(signal.SIGSTOP)
    try:
        answer = await _timed(http, stream, timeout_s=1.0)
    finally:
        tokenizer.proc.send_signal(signal.SIGCONT)
    assert answer.status == 504, answer
    _check(answer, 1.0, f"admission stalled ({'sse' if stream else 'json'})")
    # The thawed tokenizer finds the deadline passed and forwards nothing.
    await asyncio.sleep(0.5)  # quiet window: a request it forwarded anyway would reach the scheduler
    await _assert_freed(mesh, baseline, time.monotonic())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_deadline_with_no_tokenizer_at_all(mesh, baseline, http, stream) -> None:
    tokenizer = _live_tokenizer(mesh)
    tokenizer.proc.terminate()
    tokenizer.proc.wait(30)
    try:
        answer = await _timed(http, stream, timeout_s=1.0)
    finally:
        mesh.wait_ready(120, [mesh.spawn("tokenizer").name])
    assert answer.status == 504, answer
    _check(answer, 1.0, f"no tokenizer ({'sse' if stream else 'json'})")
    await _assert_freed(mesh, baseline, time.monotonic())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
async def test_the_gateway_request_timeout_flag_holds_mid_stream(mesh, baseline, stream) -> None:
    """`--request-timeout` (no header) is the same deadline."""
    name = next((s.name for s in mesh.services.values() if "--request-timeout" in s.proc.args), None)
    if name is None:
        name = mesh.spawn("gateway", ("--request-timeout", str(TIMEOUT_S))).name
        mesh.wait_ready(120, [name])
    url = mesh.services[name].ready_url.removesuffix("/ready")
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        await http.get("/health")
        answer = await _timed(http, stream, timeout_s=None)
    ended = time.monotonic()
    _check(answer, TIMEOUT_S, f"--request-timeout ({'sse' if stream else 'json'})")
    await _assert_freed(mesh, baseline, ended)
