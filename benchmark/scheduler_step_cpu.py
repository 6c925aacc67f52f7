"""The scheduler service's own work per output token, piece by piece, off the bus (prints figures, asserts nothing).

One engine step of `--streams` decoding requests, one token each, repeated `--steps` times through the real
pieces the service runs per step (services/scheduler): the step's outputs unpickled as they cross the engine
process's pipe, SchedulerTelemetry.on_outputs (ITL and token metrics, the traceparent per request),
RequestStream.add, RequestStream.next_delta (the TokenDelta), TokenDeltaBatch.pack (the wire bytes, two
batches as the chart's two detokenizers get them); then the per-delta codec the detokenizer and the gateway pay
(TokenDelta and TextDelta encode / decode). What the bus adds (NATS, the event loop, acks) is not here: the
serving path's proxy (serve_path.py) and the device's serve runs count the whole.

    .venv/bin/python benchmark/scheduler_step_cpu.py [--streams 181] [--steps 200]
"""

from __future__ import annotations

import argparse
import pickle
import time
import timeit

from kubesgl.protocol import TextDelta, TokenDelta, TokenDeltaBatch
from kubesgl.runtime.telemetry.metrics import SchedulerMetrics, new_registry
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.scheduler.streams import RequestStream
from kubesgl.values.outputs import RequestOutput


def step_pieces(streams: int, steps: int) -> dict[str, float]:
    """µs per output token of each piece, over `steps` steps of `streams` requests."""
    rids = [f"cmpl-{i:024x}" for i in range(streams)]
    telemetry = SchedulerTelemetry(
        SchedulerMetrics(new_registry(), "demo", 16, 1000), Tracing("bench"), "i", "demo"
    )
    for rid in rids:
        telemetry.on_arrival(rid, None, 500)
    by_rid = {rid: RequestStream(rid, "gw-7f3a9c", 1e12, 500) for rid in rids}
    spent = dict.fromkeys(("unpickle", "telemetry", "add", "next_delta", "pack"), 0.0)
    for s in range(steps):
        blob = pickle.dumps(("outputs", [RequestOutput(rid, [1000 + s], 500, 0, s + 1) for rid in rids], 0))
        t0 = time.perf_counter()
        outs = pickle.loads(blob)[1]
        t1 = time.perf_counter()
        parents = telemetry.on_outputs(outs, time.time_ns())
        t2 = time.perf_counter()
        for out in outs:
            by_rid[out.rid].add(out, parents.get(out.rid))
        t3 = time.perf_counter()
        deltas = [stream.next_delta("sched-0-abc") for stream in by_rid.values()]
        t4 = time.perf_counter()
        half = len(deltas) // 2
        TokenDeltaBatch.pack(deltas[:half], 1 << 20)
        TokenDeltaBatch.pack(deltas[half:], 1 << 20)
        t5 = time.perf_counter()
        for key, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4), strict=True):
            spent[key] += dt
    return {key: 1e6 * dt / (streams * steps) for key, dt in spent.items()}


def codec(repeats: int) -> dict[str, float]:
    """µs per delta of the per-step messages' encode and decode (a decode window of 9 tokens, 1 new)."""
    token = TokenDelta(rid="cmpl-" + "0" * 24, gateway_id="gw-7f3a9c", instance_id="sched-0-abc", seq=57,
                       tokens=list(range(1000, 1009)), new_from=8, prompt_tokens=800, completion_tokens=58)  # fmt: skip
    text = TextDelta(rid="cmpl-" + "0" * 24, instance_id="sched-0-abc", seq=57, text=" hello", token_ids=[1008],
                     prompt_tokens=800, completion_tokens=58)  # fmt: skip
    out = {}
    for msg in (token, text):
        body = msg.to_bytes()
        name = type(msg).__name__
        out[f"{name} bytes"] = len(body)
        out[f"{name} encode"] = 1e6 * min(timeit.repeat(msg.to_bytes, number=repeats, repeat=3)) / repeats
        decode = type(msg).from_bytes
        out[f"{name} decode"] = (
            1e6 * min(timeit.repeat(lambda d=decode, b=body: d(b), number=repeats, repeat=3)) / repeats
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=181)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    pieces = step_pieces(args.streams, args.steps)
    print(f"scheduler service, us per output token ({args.streams} streams x {args.steps} steps):")
    for key, us in pieces.items():
        print(f"  {key:<12} {us:6.2f}")
    print(f"  {'sum':<12} {sum(pieces.values()):6.2f}")
    print("per-step messages, per delta:")
    for key, value in codec(100_000).items():
        print(f"  {key:<18} {value:8.2f}" if "bytes" not in key else f"  {key:<18} {value:8d}")


if __name__ == "__main__":
    main()
