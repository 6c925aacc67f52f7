"""A bus service's process runs on uvloop's event loop where uvloop is installed (the gateway's does too:
uvicorn picks it), through the same run_bus_service the tokenizer, detokenizer and scheduler use, and freezes
its startup heap once the service has started (runtime.process.freeze_heap)."""

from __future__ import annotations

import argparse
import asyncio
import gc

import pytest
from kubesgl.runtime.bus_service import add_service_arguments, event_loop_factory, run_bus_service
from kubesgl.runtime.nats_server import NatsServer
from prometheus_client import CollectorRegistry

uvloop = pytest.importorskip("uvloop")


class LoopRecorder:
    """A bus service that records the loop it was started on and asks to stop at once."""

    exit_code = 0

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.stop.set()

    def ready(self) -> bool:
        return True

    def nats_reconnected(self) -> None:
        pass

    async def drain(self, timeout_s: float) -> None:
        pass


def test_a_bus_service_runs_on_uvloop(nats_server: NatsServer) -> None:
    assert event_loop_factory() is uvloop.new_event_loop
    parser = argparse.ArgumentParser()
    add_service_arguments(parser, drain_timeout_s=1.0)
    args = parser.parse_args(
        ["--nats-url", nats_server.url, "--admin-host", "127.0.0.1", "--admin-port", "0"]
    )
    services: list[LoopRecorder] = []

    async def build(nc: object, stop: asyncio.Event) -> LoopRecorder:
        services.append(LoopRecorder(stop))
        return services[0]

    gc.unfreeze()
    try:
        assert run_bus_service(args, "loop-test", CollectorRegistry(), build) == 0
        assert isinstance(services[0].loop, uvloop.Loop)
        assert gc.get_freeze_count() > 0  # started: the process's startup objects left the collector's view
    finally:
        gc.unfreeze()  # this is the test process's heap
