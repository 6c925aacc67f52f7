"""At-least-once delivery of one TokenDeltaBatch to the detokenizer queue group.

Sent as a NATS request; no BatchAck within the timeout (the replica died, or is stuck) means send the whole
batch again, and the queue group picks a replica anew. A detokenizer publishes every entry's TextDelta before
it acks, so a retry can duplicate TextDeltas, never lose one; the gateway drops duplicates by seq.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from kubesgl.protocol import DETOK, BatchAck, ErrorReply, ProtocolError, decode
from kubesgl.runtime.telemetry.metrics import NatsMetrics
from nats.aio.client import Client

log = logging.getLogger("kubesgl.scheduler")


async def deliver(
    nc: Client,
    batch: bytes,
    entries: int,
    metrics: NatsMetrics,
    timeout_s: float,
    give_up_s: float,
) -> BatchAck | None:
    """Sends the encoded `batch` until a detokenizer acks it; None when it was refused whole or after
    `give_up_s` of failures (`entries` only names its size in the log)."""
    give_up = time.monotonic() + give_up_s
    backoff = 0.05
    while not nc.is_closed:
        try:
            with metrics.request("detok"):
                msg = await nc.request(DETOK, batch, timeout=timeout_s)
            reply = decode(msg.data, BatchAck, ErrorReply)
            if isinstance(reply, ErrorReply):
                log.error("detokenizer refused a batch of %d deltas: %s", entries, reply.error.message)
                return None
            return reply
        except (TimeoutError, nats.errors.Error, ProtocolError) as e:
            if time.monotonic() > give_up:
                log.error("a batch of %d deltas was undeliverable: %s", entries, type(e).__name__)
                return None
            if not isinstance(e, nats.errors.TimeoutError):
                await asyncio.sleep(backoff)  # no detokenizer or no connection yet: back off
                backoff = min(1.0, backoff * 2)
    return None
