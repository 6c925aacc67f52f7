"""The tokenizer's admission against a scheduler that is alive but slow to answer (a loaded CPU box, a long
engine step): it must not turn "slow" into a 503 that fails a request the scheduler is about to admit. It asks
again (admission is idempotent per rid) and, if the time runs out, stays silent so the gateway retries the same
rid; a scheduler that refuses (503) or is gone is still answered at once."""

from __future__ import annotations

import asyncio
import time

import nats
import pytest
from kubesgl import protocol as p
from kubesgl.errors import ServiceUnavailableError
from kubesgl.routing import SchedulerRegistry, make_router
from kubesgl.runtime.telemetry.metrics import TokenizerMetrics, new_registry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.tokenizer.request_router import RequestRouter
from kubesgl.services.tokenizer.service import TokenizerService
from kubesgl.text.tokenizer import ModelTokenizer
from support.bus_client import BusClient
from support.waiting import wait_until_async

INSTANCE = "slow-0"


class FakeSlowScheduler:
    """Stands in for a scheduler's rank 0 (what this test is not about): heartbeats, and admits a rid `delay_s`
    after its first admission request arrived (its engine busy meanwhile); every attempt for that rid, first or
    retried, is answered then with the same reply, as the real scheduler's in-flight admissions are."""

    def __init__(self, nc: nats.aio.client.Client, delay_s: float, refuse: bool = False) -> None:
        self.nc, self.delay_s, self.refuse = nc, delay_s, refuse
        self.attempts: dict[str, int] = {}
        self._admitted: dict[str, asyncio.Task[None]] = {}

    async def start(self) -> None:
        await self.nc.subscribe(p.generate_subject(INSTANCE), cb=self._on_generate)
        await self.heartbeat()

    async def heartbeat(self) -> None:
        hb = p.Heartbeat(
            instance_id=INSTANCE, model="demo", context_len=4096, page_size=1, num_pages=1000, running=0,
            queued=0, free_pages=1000, available_pages=1000, max_running_requests=8, draining=False,
            ts=time.time(),
        )  # fmt: skip
        await self.nc.publish(p.HEARTBEAT, hb.to_bytes())

    async def _on_generate(self, msg: nats.aio.msg.Msg) -> None:
        req = p.GenerateRequest.from_bytes(msg.data)
        self.attempts[req.rid] = self.attempts.get(req.rid, 0) + 1
        if req.rid not in self._admitted:
            # Scenario timing: the busy engine admits `delay_s` after the first attempt.
            self._admitted[req.rid] = asyncio.create_task(asyncio.sleep(self.delay_s))
        asyncio.create_task(self._answer(msg, req))  # nats-py runs callbacks one at a time

    async def _answer(self, msg: nats.aio.msg.Msg, req: p.GenerateRequest) -> None:
        await asyncio.shield(self._admitted[req.rid])
        if self.refuse:
            reply: p.Message = p.ErrorReply.from_error(req.rid, ServiceUnavailableError("full"))
        else:
            reply = p.Admitted(rid=req.rid, instance_id=INSTANCE, prompt_tokens=len(req.input_ids))
        await msg.respond(reply.to_bytes())


async def _tokenizer(url: str, model_dir: str) -> TokenizerService:
    nc = await nats.connect(url)
    registry = new_registry()
    metrics = TokenizerMetrics(registry)
    router = RequestRouter("least-load", make_router("least-load"), metrics.router)
    svc = TokenizerService(
        nc, ModelTokenizer.load(model_dir), "demo", router, SchedulerRegistry(), metrics, Tracing("test")
    )
    await svc.start()
    return svc


async def _beat(sched: FakeSlowScheduler, stop: asyncio.Event) -> None:
    while not stop.is_set():
        await sched.heartbeat()
        await asyncio.sleep(p.HEARTBEAT_INTERVAL_S)  # scenario timing: a scheduler's heartbeat period


@pytest.mark.parametrize(
    ("delay_s", "gateway_attempts"),
    [(3.0, 1), (6.0, 2)],
    ids=["slower-than-one-attempt", "slower-than-the-whole-admission"],
)
async def test_a_slow_scheduler_is_waited_for_not_refused(
    nats_server, demo_model_dir: str, delay_s: float, gateway_attempts: int
) -> None:
    url = nats_server.url
    sched_nc = await nats.connect(url)
    sched = FakeSlowScheduler(sched_nc, delay_s)
    await sched.start()
    stop = asyncio.Event()
    beating = asyncio.create_task(_beat(sched, stop))
    svc = await _tokenizer(url, demo_model_dir)
    client = await BusClient.connect(url)
    try:
        await wait_until_async(svc.registry.live, "the tokenizer hears the scheduler's heartbeat")
        reply = await client.submit(prompt="hello", sampling={"max_tokens": 4}, attempt_timeout_s=5.0)
        assert isinstance(reply, p.Admitted), reply
        # Within the tokenizer's 4 s the slow instance is asked again (attempts of 2 s); past them the tokenizer
        # stays silent and the gateway's retry of the same rid (after its 5 s attempt) is admitted.
        assert client.attempts[reply.rid] == gateway_attempts
        assert sched.attempts[reply.rid] >= 2
    finally:
        stop.set()
        await beating
        await client.close()
        await svc.drain(1.0)
        await sched_nc.close()


async def test_a_full_scheduler_is_still_a_503_at_once(nats_server, demo_model_dir: str) -> None:
    url = nats_server.url
    sched_nc = await nats.connect(url)
    sched = FakeSlowScheduler(sched_nc, 0.0, refuse=True)
    await sched.start()
    stop = asyncio.Event()
    beating = asyncio.create_task(_beat(sched, stop))  # heard by the tokenizer, which starts after the first
    svc = await _tokenizer(url, demo_model_dir)
    client = await BusClient.connect(url)
    try:
        await wait_until_async(svc.registry.live, "the tokenizer hears the scheduler's heartbeat")
        start = time.monotonic()
        reply = await client.submit(prompt="hello", sampling={"max_tokens": 4}, attempt_timeout_s=5.0)
        assert isinstance(reply, p.ErrorReply) and reply.error.status == 503, reply
        assert reply.rid in sched.attempts  # refused by the full scheduler, not for want of one
        assert time.monotonic() - start < 2.0
    finally:
        stop.set()
        await beating
        await client.close()
        await svc.drain(1.0)
        await sched_nc.close()
