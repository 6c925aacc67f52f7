"""LoopLocal: one object per event loop, and a loop that has ended is freed with its objects (the gateway's SSE
flusher and per-turn token metrics each keep one per loop; its stream ticker keeps its last, done task, which
holds the loop: a test elsewhere pins that task)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest
from kubesgl.runtime.loop_local import LoopLocal
from kubesgl.runtime.telemetry import metrics
from kubesgl.runtime.telemetry.metrics import GatewayMetrics
from kubesgl.services.gateway import sse_writer
from kubesgl.services.gateway.sse_writer import SseWriter
from prometheus_client import CollectorRegistry


def test_each_loop_gets_its_own_object_and_none_exists_outside_a_loop() -> None:
    local: LoopLocal[object] = LoopLocal(object)

    async def twice() -> tuple[object, object]:
        return local.get(), local.get()

    a1, a2 = asyncio.run(twice())
    b1, _ = asyncio.run(twice())
    assert a1 is a2 and a1 is not b1
    assert local.running() is None
    with pytest.raises(RuntimeError):
        local.get()


def test_an_ended_loop_is_freed_with_the_gateways_loop_local_objects() -> None:
    async def stream_once() -> None:
        sent: list[dict[str, Any]] = []

        async def send(message: dict[str, Any]) -> None:  # FAKE server send: records the message
            sent.append(message)

        writer: SseWriter[str] = SseWriter(send, lambda items: "".join(items).encode())
        writer.add("a", 1)  # the flusher
        request = GatewayMetrics(CollectorRegistry()).request("m", "/v1/completions")
        request.on_tokens(1)
        request.on_tokens(1)  # the turn's token metrics
        await asyncio.sleep(0)
        assert sent and sent[0]["body"] == b"a"

    asyncio.run(stream_once())
    gc.collect()
    for local in (sse_writer._flushers, metrics._turns):
        assert len(local._by_loop) == 0, local._make
