"""Overload on the local stack: two schedulers with room for 2 running + 1 queued request each get a burst of
16 concurrent requests (half streamed). What does not fit is shed with 503, Retry-After and OpenAI's error body; what was
admitted completes in full; nothing crashes; once the burst is over, requests succeed again."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from kubesgl.launcher import Stack

pytestmark = pytest.mark.timeout(300)

MODEL = "demo"
BURST = 16
MAX_TOKENS = 32
LIMITS = ("--max-running-requests", "2", "--max-queued-requests", "1")


@pytest.fixture(scope="module")
def small(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(
        tmp_path_factory.mktemp("overload"), schedulers=2, scheduler_args=(*TEST_SCHEDULER_ARGS, *LIMITS)
    )
    yield stack
    stack.stop(timeout_s=10)


def _body(i: int) -> dict:
    prompt = f"overload {i}: tell me a story"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0}
    return body | {"stream": i % 2 == 1}  # half streamed: a stream is refused before its first byte, too


async def test_a_burst_beyond_every_scheduler_is_shed_with_503_and_recovers(small: Stack) -> None:
    async with httpx.AsyncClient(base_url=small.gateway_urls[0], timeout=120) as http:
        burst = await asyncio.gather(*(http.post("/v1/completions", json=_body(i)) for i in range(BURST)))
        shed = [r for r in burst if r.status_code == 503]
        served = [r for r in burst if r.status_code == 200]
        assert len(shed) + len(served) == BURST, [(r.status_code, r.text) for r in burst]
        assert shed and served, [r.status_code for r in burst]
        for r in shed:
            error = r.json()["error"]
            assert r.headers["retry-after"] and error["type"] == "service_unavailable", r.text
            assert "is full" in error["message"], error
        for r in served:
            if r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.endswith("data: [DONE]\n\n") and '"error"' not in r.text, r.text
            else:
                assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS, r.text
        assert small.dead() == []
        # The burst is over: the same load, one request at a time, is served again.
        again = [await http.post("/v1/completions", json=_body(i)) for i in range(4)]
        assert [r.status_code for r in again] == [200] * 4, [r.text for r in again]
