"""At-least-once delivery of one TokenDelta to the detokenizer queue group.

Sent as a NATS request; no Ack within the timeout (the replica died, or is stuck) means send again, and the
queue group picks a replica anew. A detokenizer publishes before it acks, so a retry can duplicate a
TextDelta, never lose one; the gateway drops duplicates by seq.
"""

from __future__ import annotations

import asyncio
import logging
import time

import nats.errors
from kubesgl.protocol import DETOK, Ack, ErrorReply, ProtocolError, TokenDelta, decode
from kubesgl.telemetry.metrics import NatsMetrics
from nats.aio.client import Client

log = logging.getLogger("kubesgl.scheduler")


async def deliver(
    nc: Client,
    delta: TokenDelta,
    hdrs: dict[str, str],
    metrics: NatsMetrics,
    timeout_s: float,
    give_up_s: float,
) -> bool:
    """Sends `delta` until a detokenizer acks it; False when refused or after `give_up_s` of failures."""
    data = delta.to_bytes()
    give_up = time.monotonic() + give_up_s
    backoff = 0.05
    while not nc.is_closed:
        try:
            with metrics.request("detok"):
                msg = await nc.request(DETOK, data, timeout=timeout_s, headers=hdrs)
            reply = decode(msg.data, Ack, ErrorReply)
            if isinstance(reply, ErrorReply):
                log.error("detokenizer refused delta %d of %s: %s", delta.seq, delta.rid, reply.message)
            return isinstance(reply, Ack)
        except (TimeoutError, nats.errors.Error, ProtocolError) as e:
            if time.monotonic() > give_up:
                log.error("delta %d of %s undeliverable: %s", delta.seq, delta.rid, type(e).__name__)
                return False
            if not isinstance(e, nats.errors.TimeoutError):
                await asyncio.sleep(backoff)  # no detokenizer or no connection yet: back off
                backoff = min(1.0, backoff * 2)
    return False
