"""The gateway's own work per streamed token, piece by piece, off the bus and the socket (prints figures, asserts
nothing).

`--streams` plain single-choice /v1/completions streams (no stop strings, no logprobs: what the serve runs send)
each get one token per step, `--steps` times, through the real pieces a gateway runs per token
(services/gateway): the step's TextDeltaBatch decoded (`gateway_deltas`), each delta delivered
(RequestStream.offer -> ChoiceGeneration's sink -> SseWriter.add), then the loop's turn: every stream's staged
event rendered (CompletionEncoder's pre-encoded frame), counted by its GatewayRequestMetrics and handed to the
server's `send`. That `send` is a named fake that keeps the bytes (uvicorn's own costs a loopback write, ~4 µs
of CPU on the 2-core box, the kernel's receive side included: not this script's subject). What NATS and the
event loop's I/O add is not here: serve_path.py and the device's serve runs count the whole.

    .venv/bin/python benchmark/gateway_stream_cpu.py [--streams 128] [--steps 300]
"""

from __future__ import annotations

import argparse
import asyncio
import time

from kubesgl.protocol import PromptKind, SamplingParams, TextDelta, TextDeltaBatch, TokenizeRequest
from kubesgl.protocol.deltas import gateway_deltas
from kubesgl.runtime.telemetry.metrics import GatewayMetrics, new_registry
from kubesgl.services.gateway.encoders import CompletionEncoder
from kubesgl.services.gateway.generation import ChoiceGeneration, Limits, joined
from kubesgl.services.gateway.request_stream import RequestStream
from kubesgl.services.gateway.sse_writer import SseWriter, _flushers

INSTANCE = "scheduler-0-7f3a9c"


class FakeServerSend:
    """Stands in for uvicorn's `send` (named fake: the socket write is not what this measures); keeps the bytes
    so the figures can be checked against what a stream should have carried."""

    def __init__(self) -> None:
        self.bytes = 0

    async def __call__(self, message: dict) -> None:
        self.bytes += len(message.get("body", b""))


def _streams(n: int, metrics: GatewayMetrics) -> tuple[dict[str, RequestStream], FakeServerSend]:
    send = FakeServerSend()
    by_rid: dict[str, RequestStream] = {}
    for i in range(n):
        rid = f"cmpl-{i:024x}"
        stream = RequestStream(rid)
        stream.adopt(INSTANCE)
        request = TokenizeRequest(
            rid=rid,
            gateway_id="gw-0",
            model="demo",
            kind=PromptKind.COMPLETION,
            sampling=SamplingParams(),
            deadline=time.time() + 1e6,
            prompt="x",
        )
        # The bus is not touched by delivery (only by admit and close, not run here).
        choice = ChoiceGeneration(None, 0, request, (), Limits(time.time() + 1e6, 1e6))  # type: ignore[arg-type]
        choice._stream = stream
        encoder = CompletionEncoder(rid, "demo", 1, include_usage=False)
        request_metrics = metrics.request("demo", "completions")
        writer: SseWriter = SseWriter(
            send, render=lambda events, e=encoder: e.frames(joined(events)), on_sent=request_metrics.on_tokens
        )
        choice.push_events(lambda event, w=writer: w.add(event, len(event.token_ids)))
        by_rid[rid] = stream
    return by_rid, send


async def _run(streams: int, steps: int) -> dict[str, float]:
    metrics = GatewayMetrics(new_registry())
    by_rid, send = _streams(streams, metrics)
    words = [" the", " quick", " brown", " fox", " jumps", " over", " a", " lazy", " dog", ","]
    spent = dict.fromkeys(("decode", "deliver", "render + send", "turn"), 0.0)
    flusher = _flushers.get()
    for s in range(steps):
        body = TextDeltaBatch(
            deltas=[
                TextDelta(
                    rid=rid, instance_id=INSTANCE, seq=s, text=words[(s + i) % 10], token_ids=[1000 + s]
                )
                for i, rid in enumerate(by_rid)
            ]
        ).to_bytes()
        t0 = time.perf_counter()
        deltas = gateway_deltas(body)
        t1 = time.perf_counter()
        for delta in deltas:
            by_rid[delta.rid].offer(delta)
        t2 = time.perf_counter()
        flusher._run()  # the loop's turn, as its call_soon would run it
        t3 = time.perf_counter()
        await asyncio.sleep(
            0
        )  # the rest of the turn: the metrics' per-turn flush (and the flusher's empty call)
        t4 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
            spent[key] += dt
    tokens = streams * steps
    out = {k: v / tokens * 1e6 for k, v in spent.items()}
    out["bytes per token"] = send.bytes / tokens
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=128, help="a gateway's share of a step (256 over two)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for r in range(args.repeat):
        out = asyncio.run(_run(args.streams, args.steps))
        per_token = sum(v for k, v in out.items() if k != "bytes per token")
        pieces = ", ".join(f"{k} {v:.2f}" for k, v in out.items() if k != "bytes per token")
        print(
            f"run {r}: µs per token: {pieces}; sum {per_token:.2f} "
            f"({out['bytes per token']:.0f} bytes per token to the fake send)"
        )


if __name__ == "__main__":
    main()
