"""A raw NATS client playing the gateway's part of the wire protocol, for the bus tests: it sends
TokenizeRequests (retrying a timed-out one with the same rid, as the protocol says), and reassembles each
request's TextDeltas in seq order, dropping duplicates."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import msgpack
import nats
import nats.errors
from kubesgl import protocol as p
from kubesgl.values.sampling import SamplingParams
from nats.aio.client import Client
from nats.aio.msg import Msg


@dataclass
class Stream:
    deltas: dict[int, p.TextDelta] = field(default_factory=dict)
    duplicates: int = 0
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def ordered(self) -> list[p.TextDelta]:
        return [self.deltas[s] for s in sorted(self.deltas)]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.ordered)

    @property
    def token_ids(self) -> list[int]:
        return [t for d in self.ordered for t in d.token_ids]

    @property
    def last(self) -> p.TextDelta:
        return self.ordered[-1]


class BusClient:
    def __init__(self, nc: Client, gateway_id: str) -> None:
        self.nc = nc
        self.gateway_id = gateway_id
        self.streams: dict[str, Stream] = {}
        self.attempts: dict[str, int] = {}

    @classmethod
    async def connect(cls, url: str) -> BusClient:
        nc = await nats.connect(url, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        client = cls(nc, f"testgw-{uuid.uuid4().hex[:8]}")
        await nc.subscribe(p.gateway_subject(client.gateway_id), cb=client._on_delta)
        return client

    async def close(self) -> None:
        await self.nc.close()

    async def _on_delta(self, msg: Msg) -> None:
        for delta in p.gateway_deltas(msg.data):
            self._take(delta)

    def _take(self, delta: p.TextDelta) -> None:
        stream = self.streams.setdefault(delta.rid, Stream())
        if delta.seq in stream.deltas:
            stream.duplicates += 1
            return
        stream.deltas[delta.seq] = delta
        seqs = sorted(stream.deltas)
        if stream.last.finished and seqs == list(range(len(seqs))):
            stream.done.set()

    async def submit(
        self,
        *,
        kind: str = "completion",
        prompt: str | None = None,
        messages: list[dict[str, Any]] | None = None,
        input_ids: list[int] | None = None,
        params: SamplingParams | None = None,
        sampling: dict[str, Any] | None = None,
        model: str = "demo",
        rid: str | None = None,
        deadline_s: float = 60.0,
        attempt_timeout_s: float = 5.0,
        attempts: int = 5,
    ) -> p.Admitted | p.ErrorReply:
        """Sends one TokenizeRequest, retrying a timed-out attempt with the same rid. `sampling`, when given, goes
        on the wire in place of `params`' map as it is (to send what no SamplingParams would hold)."""
        rid = rid or uuid.uuid4().hex
        self.streams.setdefault(rid, Stream())
        req = p.TokenizeRequest(
            rid=rid,
            gateway_id=self.gateway_id,
            model=model,
            kind=p.PromptKind(kind),
            prompt=prompt,
            messages=tuple(p.ChatMessage(**m) for m in messages or ()),
            input_ids=input_ids,
            sampling=params or SamplingParams(),
            deadline=time.time() + deadline_s,
        )
        body = req.to_bytes()
        if sampling is not None:
            body = msgpack.packb({**msgpack.unpackb(body), "sampling": sampling})
        for attempt in range(1, attempts + 1):
            self.attempts[rid] = attempt
            try:
                msg = await self.nc.request(
                    p.TOKENIZE,
                    body,
                    timeout=attempt_timeout_s,
                    headers=p.headers(rid, req.deadline),
                )
                return p.decode(msg.data, p.Admitted, p.ErrorReply)
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                continue
        raise TimeoutError(f"{rid}: no admission after {attempts} attempts")

    async def result(self, rid: str, timeout_s: float = 60.0) -> Stream:
        stream = self.streams[rid]
        await asyncio.wait_for(stream.done.wait(), timeout_s)
        return stream

    async def generate(self, timeout_s: float = 60.0, **kwargs: Any) -> Stream:
        reply = await self.submit(**kwargs)
        assert isinstance(reply, p.Admitted), reply
        return await self.result(reply.rid, timeout_s)

    async def scheduler_stats(self, instance_id: str) -> p.SchedulerStats:
        msg = await self.nc.request(p.stats_subject(instance_id), b"", timeout=5)
        return p.SchedulerStats.from_bytes(msg.data)
