"""Online benchmark: replay a request trace against kubesgl's OpenAI API at its recorded arrival times.

    python loadtest/replay.py --base-url http://127.0.0.1:8000 --synthetic --num-requests 200 --rate 4
    python loadtest/replay.py --base-url $URL --trace mooncake.jsonl --timestamp-unit ms --time-scale 0.5

A trace is JSONL, one request per line: {"timestamp": T, "input_len": I, "output_len": O} (Mooncake's
"input_length"/"output_length" are read too). Requests go out open-loop at (T - T0) * time_scale seconds
(0.5 replays twice as fast), each a streaming /v1/completions of exactly I random prompt tokens and O output
tokens (ignore_eos), so the server sees the trace's lengths whatever its tokenizer. The synthetic trace has
Poisson arrivals at --rate and lengths uniform within +-spread of the means. Prints TTFT, TBT (time between
tokens) and end-to-end latency percentiles and throughput; --out writes them, with every request, as JSON.
Exits 1 when any request failed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_timing import StreamTimer  # noqa: E402
from workload import auth_headers, completion_body  # noqa: E402


@dataclass(frozen=True)
class TraceRequest:
    timestamp: float  # seconds
    input_len: int
    output_len: int


@dataclass
class RequestResult:
    index: int
    sent_at: float  # seconds after the replay started
    input_len: int
    output_len: int
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    completion_tokens: int | None = None
    tbts: list[float] = field(default_factory=list)


def synthetic_trace(
    num_requests: int, rate: float, input_len: int, output_len: int, spread: float, seed: int
) -> list[TraceRequest]:
    """Poisson arrivals at `rate` requests/s; lengths uniform in [mean*(1-spread), mean*(1+spread)]."""
    if num_requests < 1 or rate <= 0 or input_len < 1 or output_len < 1 or not 0 <= spread < 1:
        raise ValueError("need num_requests >= 1, rate > 0, lengths >= 1 and 0 <= spread < 1")
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(num_requests):
        out.append(TraceRequest(t, _spread(rng, input_len, spread), _spread(rng, output_len, spread)))
        t += rng.expovariate(rate)
    return out


def _spread(rng: random.Random, mean: int, spread: float) -> int:
    return max(1, rng.randint(round(mean * (1 - spread)), round(mean * (1 + spread))))


def load_trace(path: Path, timestamp_unit: str = "s") -> list[TraceRequest]:
    """Reads a JSONL trace; ValueError naming the line of a bad row. Sorted by timestamp."""
    scale = {"s": 1.0, "ms": 1e-3}[timestamp_unit]
    out = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            req = TraceRequest(
                float(row["timestamp"]) * scale,
                int(row.get("input_len", row.get("input_length"))),
                int(row.get("output_len", row.get("output_length"))),
            )
        except (ValueError, TypeError, KeyError) as e:
            raise ValueError(
                f"{path}:{n}: not a trace row with timestamp, input_len, output_len ({e})"
            ) from None
        if req.input_len < 1 or req.output_len < 1:
            raise ValueError(f"{path}:{n}: input_len and output_len must be >= 1")
        out.append(req)
    if not out:
        raise ValueError(f"{path}: no requests")
    return sorted(out, key=lambda r: r.timestamp)


def send_offsets(trace: list[TraceRequest], time_scale: float) -> list[float]:
    """When each request goes out, in seconds after the first."""
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    t0 = trace[0].timestamp
    return [(r.timestamp - t0) * time_scale for r in trace]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100) by linear interpolation, None for no values."""
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def summarize(results: list[RequestResult], wall_s: float) -> dict[str, Any]:
    done = [r for r in results if r.ok]
    ttfts = [r.ttft for r in done if r.ttft is not None]
    tbts = [g for r in done for g in r.tbts]
    e2es = [r.e2e for r in done if r.e2e is not None]
    tokens = sum(r.completion_tokens or 0 for r in done)

    def pct(values: list[float]) -> dict[str, float | None]:
        return {f"p{q}": percentile(values, q) for q in (50, 90, 99)}

    return {
        "requests": len(results),
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": wall_s,
        "request_throughput": len(done) / wall_s if wall_s > 0 else 0.0,
        "output_token_throughput": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s": pct(ttfts),
        "tbt_s": pct(tbts),
        "e2e_s": pct(e2es),
    }


async def replay(
    client: httpx.AsyncClient,
    model: str,
    trace: list[TraceRequest],
    time_scale: float,
    token_ids: tuple[int, int],
    seed: int,
) -> tuple[list[RequestResult], float]:
    """Sends every request at its offset; returns the results in trace order and the wall time."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(*token_ids) for _ in range(r.input_len)] for r in trace]
    start = time.perf_counter()

    async def one(i: int, req: TraceRequest, offset: float) -> RequestResult:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        return await _send(client, model, i, req, prompts[i], start)

    offsets = send_offsets(trace, time_scale)
    results = await asyncio.gather(
        *(one(i, r, o) for i, (r, o) in enumerate(zip(trace, offsets, strict=True)))
    )
    return list(results), time.perf_counter() - start


async def _send(
    client: httpx.AsyncClient, model: str, i: int, req: TraceRequest, input_ids: list[int], start: float
) -> RequestResult:
    sent = time.perf_counter()
    result = RequestResult(i, sent - start, req.input_len, req.output_len, ok=False)
    timer = StreamTimer(sent)
    try:
        body = completion_body(model, input_ids, req.output_len)
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                result.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return result
            async for line in resp.aiter_lines():
                timer.on_line(line, time.perf_counter())
    except httpx.HTTPError as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.error = timer.failure()
    result.ok = result.error is None
    result.ttft, result.tbts, result.completion_tokens = timer.ttft, timer.itls, timer.completion_tokens
    result.e2e = time.perf_counter() - sent
    return result


async def _first_model(client: httpx.AsyncClient) -> str:
    resp = await client.get("/v1/models")
    models = resp.json().get("data", []) if resp.status_code == 200 else []
    if not models:
        raise SystemExit(f"set --model: GET /v1/models answered {resp.status_code}")
    return models[0]["id"]


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Defaults from the same variables the k6 and locust scripts read.
    p.add_argument("--base-url", default=os.environ.get("BASE_URL", "http://127.0.0.1:8000"))
    p.add_argument("--api-key", default=os.environ.get("API_KEY", ""), help="sent as a Bearer token")
    p.add_argument("--model", default=os.environ.get("MODEL", ""), help="default: the first of /v1/models")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", type=Path, help="JSONL trace: timestamp, input_len, output_len per line")
    src.add_argument("--synthetic", action="store_true", help="generate a Poisson trace")
    p.add_argument("--timestamp-unit", choices=["s", "ms"], default="s")
    p.add_argument("--time-scale", type=float, default=1.0, help="multiplies inter-arrival gaps")
    p.add_argument("--num-requests", type=int, default=100)
    p.add_argument("--rate", type=float, default=2.0, help="synthetic arrivals per second")
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--spread", type=float, default=0.5, help="synthetic lengths vary by +- this share")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-ids", default="100:1000", help="LOW:HIGH range of random prompt token ids")
    p.add_argument("--timeout", type=float, default=300.0, help="per request, seconds")
    p.add_argument("--write-trace", type=Path, help="also save the replayed trace as JSONL")
    p.add_argument("--out", type=Path, help="write the summary and every request as JSON")
    return p.parse_args(argv)


async def _main(args: argparse.Namespace) -> int:
    if args.trace:
        trace = load_trace(args.trace, args.timestamp_unit)
    else:
        trace = synthetic_trace(
            args.num_requests, args.rate, args.input_len, args.output_len, args.spread, args.seed
        )
    if args.write_trace:
        args.write_trace.write_text("".join(json.dumps(asdict(r)) + "\n" for r in trace))
    low, high = (int(x) for x in args.token_ids.split(":"))
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=args.base_url, headers=auth_headers(args.api_key), timeout=args.timeout, limits=limits
    ) as client:
        model = args.model or await _first_model(client)
        results, wall = await replay(client, model, trace, args.time_scale, (low, high), args.seed)
    summary = summarize(results, wall)
    print(json.dumps(summary, indent=2))
    for r in results:
        if not r.ok:
            print(f"request {r.index} failed: {r.error}", file=sys.stderr)
    if args.out:
        args.out.write_text(
            json.dumps({"summary": summary, "requests": [asdict(r) for r in results]}, indent=1)
        )
    return 0 if summary["failed"] == 0 else 1


def main(argv: list[str] | None = None) -> int:
    return asyncio.run(_main(_parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
