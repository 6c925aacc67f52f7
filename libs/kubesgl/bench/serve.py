"""`kubesgl bench serve`: drives a running gateway with the seed workload shape and compares it with the
offline LLM on the same requests.

Workload: kubesgl.bench.offline's (python `random` seeded 0, or `--seed`; prompts of randint(min_in, max_in)
token ids from randint(0, 10000), then max_tokens randint(min_out, max_out) each; temperature 0.6; EOS
ignored), with defaults scaled down for a CPU. Every request is a streamed /v1/completions call with token-id
prompts, sent at once (or `--max-concurrency` at a time) over connections opened before the burst's clock starts
(`--no-connect-first`: each connects as it starts). Reported: output tok/s over the wall time, TTFT p50/p99,
ITL p50/p99 (gaps between streamed chunks, as a client sees them) and TPOT (per request, (last - first
chunk) / (tokens - 1)), beside the gateway's own TTFT mean over the same burst (its /metrics), which should
agree with the client's. Requests go out through sse_client, not httpx, whose pool would queue them.

Several gateways (`--url` repeated or comma-separated, e.g. `kubesgl up --gateways 4`'s ports): the streams go
round-robin over them, as a Service spreads connections over gateway pods, and the gateway TTFT sums every
gateway's histogram. With `--model`, the offline LLM then runs the same requests: the ratio serving/offline,
the TTFT the bus adds (one request alone, through the first gateway vs. offline prefill), and the served TTFT p99
against the offline engine's for the same arrival: all at once, and each request given to it when the served
one was written (both counted from that moment).
`--workload shared-prefix` runs multi-turn conversations over shared prefixes instead (shared_prefix.py) and
adds the cache hit rate, to compare routing policies.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from kubesgl import env
from kubesgl.bench import shared_prefix
from kubesgl.bench.offline import make_workload
from kubesgl.bench.sse_client import Connection, HttpStatusError, connect, post_events
from kubesgl.bench.timing import RequestTiming, percentile
from kubesgl.runtime.process import freeze_heap

SINGLE_TTFT_RUNS = 5
WARM_UP_TIMEOUT_S = 60.0
DEFAULT_URL = "http://127.0.0.1:8000"


def gateway_urls(args: argparse.Namespace) -> list[str]:
    """Every `--url`, commas split, in order (the default gateway when none is given)."""
    urls = [u.strip().rstrip("/") for arg in args.url or [DEFAULT_URL] for u in arg.split(",") if u.strip()]
    if not urls:
        raise SystemExit("kubesgl bench serve: --url names no gateway")
    return urls


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        action="append",
        default=None,
        help="gateway base URL; repeat it or separate URLs with commas to spread the streams round-robin "
        f"over several gateways (default {DEFAULT_URL})",
    )
    p.add_argument("--api-key", default=env.api_key(), help="env KUBESGL_API_KEY")
    p.add_argument("--served-model", default=None, help="model id to request (default: the first served)")
    p.add_argument("--num-seqs", type=int, default=32)
    p.add_argument("--min-input", type=int, default=16)
    p.add_argument("--max-input", type=int, default=256)
    p.add_argument("--min-output", type=int, default=16)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.6)
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="workload seed (0: the seed workload); a second run on the same stack needs another, or its "
        "prompts hit the prefix cache the first run filled",
    )
    p.add_argument("--max-concurrency", type=int, default=0, help="requests in flight at once (0 = all)")
    p.add_argument(
        "--connect-first",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="open the burst's connections before its clock starts, then write every request together (a "
        "client's warm connections); --no-connect-first connects each request as it starts (the burst's sends "
        "then spread over one event loop's connects)",
    )
    p.add_argument("--model", default=None, help="model dir: also run the offline LLM on the same requests")
    p.add_argument("--device", default="cpu", help="offline LLM device (match the scheduler's)")
    p.add_argument("--page-size", type=int, default=1, help="offline LLM page size (match the scheduler's)")
    p.add_argument("--num-pages", type=int, default=None, help="offline LLM KV pages")
    p.add_argument(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="offline LLM graph batch limit (match the scheduler's)",
    )
    p.add_argument(
        "--piecewise-cuda-graph-max-tokens",
        type=int,
        default=None,
        help="offline LLM piecewise prefill graphs (match the scheduler's; 0 disables)",
    )
    p.add_argument(
        "--dummy-weight", action="store_true", help="offline LLM on random weights (as the scheduler's flag)"
    )
    p.add_argument("--json", default=None, help="append the figures as one JSON line to this file")
    p.add_argument(
        "--burst-hook",
        default=None,
        help="a shell command run right before the burst's clock starts and right after its last stream ends "
        "(BURST_PHASE=start / end in its environment), e.g. a snapshot of the services' CPU time that "
        "leaves out the warm-up and the offline LLM's run",
    )
    p.add_argument(
        "--workload",
        default="seed",
        choices=["seed", "shared-prefix"],
        help="seed: the seed workload shape; shared-prefix: multi-turn groups sharing a long prefix",
    )
    shared_prefix.add_arguments(p)


def main(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    if args.workload == "shared-prefix":
        return _report(asyncio.run(_serve_shared_prefix(args, headers)), args)
    prompts, max_tokens = make_workload(args, args.seed)
    res: dict[str, Any] = {
        "seed": args.seed,
        "requests": len(prompts),
        "prompt_tokens": sum(map(len, prompts)),
        "requested_output_tokens": sum(max_tokens),
    }
    figures, arrivals = asyncio.run(_serve(args, prompts, max_tokens, headers))
    res.update(figures)
    if args.model:
        res.update(_offline(args, prompts, max_tokens, arrivals))
        res["serving_over_offline"] = round(res["output_tok_s"] / res["offline_output_tok_s"], 3)
        res["bus_ttft_overhead_s"] = round(res["single_ttft_s"] - res["offline_single_ttft_s"], 4)
        res["ttft_p99_over_offline"] = _ratio(res["ttft_p99_s"], res["offline_ttft_p99_s"])
        # Without the client's own send of the burst (its connects and writes, one event loop for all 256).
        res["ttft_after_send_p99_over_offline"] = _ratio(
            res["ttft_after_send_p99_s"], res["offline_ttft_p99_s"]
        )
        # The same arrival, exactly: the offline engine given each request when the served one was written,
        # both TTFTs counted from that moment.
        res["ttft_after_send_p99_over_offline_same_arrival"] = _ratio(
            res["ttft_after_send_p99_s"], res["offline_arrival_ttft_p99_s"]
        )
    return _report(res, args)


def _ratio(a: float | None, b: float | None) -> float | None:
    """a / b to 3 places, or None where either is missing (or b is 0)."""
    return round(a / b, 3) if a and b else None


def _report(res: dict[str, Any], args: argparse.Namespace) -> int:
    _print(res)
    if args.json:
        with open(args.json, "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0 if res["failed"] == 0 else 1


def _client(headers: dict[str, str]) -> httpx.AsyncClient:
    """For the gateways' /v1/models and /metrics (the streams go through sse_client)."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(30.0, read=None)
    return httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout)


async def _serve_shared_prefix(args: argparse.Namespace, headers: dict[str, str]) -> dict[str, Any]:
    urls = gateway_urls(args)
    async with _client(headers) as http:
        model = args.served_model or await _first_model(http, urls[0])
        for url in urls:
            await _warm_up(url, headers, model, [1, 2, 3, 4, 5, 6, 7, 8], args.temperature)
        sent = itertools.count()

        async def send(ids: list[int], n: int) -> RequestTiming:
            url = urls[next(sent) % len(urls)]
            return await _stream(url, headers, _body(model, ids, n, args.temperature))

        return {"served_model": model, "gateways": len(urls), **await shared_prefix.run(send, args)}


async def _serve(
    args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int], headers: dict[str, str]
) -> tuple[dict[str, Any], list[float] | None]:
    """The burst's figures, and when each request was written (seconds from the burst's start: the offline
    replay's arrivals; None when a request failed, which fails the run anyway)."""
    urls = gateway_urls(args)
    async with _client(headers) as http:
        model = args.served_model or await _first_model(http, urls[0])
        for url in urls:
            await _warm_up(url, headers, model, prompts[0][:8], args.temperature)
        at_once = min(len(prompts), args.max_concurrency or len(prompts))
        gate = asyncio.Semaphore(at_once)
        url_of = [urls[i % len(urls)] for i in range(len(prompts))]  # round-robin, as a Service spreads them
        bodies = [_body(model, p, n, args.temperature) for p, n in zip(prompts, max_tokens, strict=True)]
        before = await _gateway_ttft(http, urls, model)
        # The requests that start at once get their connections first (a client's warm connections), so the
        # burst's writes leave together: its TTFT is then the server's, not one event loop's connects.
        # A connect that fails here is tried again by its request, which reports the error as any other.
        opened = (
            await asyncio.gather(*(connect(url_of[i]) for i in range(at_once)), return_exceptions=True)
            if args.connect_first
            else []
        )
        hook_failed = ["start"] if await burst_hook(args.burst_hook, "start") else []
        start = time.perf_counter()

        async def one(i: int) -> RequestTiming:
            async with gate:
                conn = opened[i] if i < len(opened) and not isinstance(opened[i], BaseException) else None
                return await _stream(url_of[i], headers, bodies[i], origin=start, connection=conn)

        timings = await asyncio.gather(*(one(i) for i in range(len(prompts))))
        wall = time.perf_counter() - start
        hook_failed += ["end"] if await burst_hook(args.burst_hook, "end") else []
        after = await _gateway_ttft(http, urls, model)
        singles = [
            await _stream(urls[0], headers, _body(model, prompts[0], 1, args.temperature))
            for _ in range(SINGLE_TTFT_RUNS)
        ]
    ok = [t for t in timings if t.error is None]
    out_tokens = sum(t.completion_tokens for t in ok)
    gaps = [g for t in ok for g in t.gaps]
    text_events = len(gaps) + sum(t.first is not None for t in ok)
    tpots = [
        (t.last - t.first) / (t.completion_tokens - 1)
        for t in ok
        if t.first is not None and t.last is not None and t.completion_tokens > 1
    ]
    errors = sorted({t.error for t in timings if t.error})
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    counted = after[1] - before[1] if after and before else 0
    gateway_mean = round((after[0] - before[0]) / counted, 4) if counted > 0 else None
    client_mean = round(statistics.mean(ttfts), 4) if ttfts else None
    # The same TTFTs from the moment each request was written: what any server clock can see (the client's own
    # connect and send, in one event loop opening every connection of the burst, are before that).
    after_send = [t.ttft - t.sent for t in ok if t.ttft is not None and t.sent is not None]
    after_send_mean = round(statistics.mean(after_send), 4) if after_send else None
    sends = [t.sent for t in ok if t.sent is not None]
    figures = {
        "served_model": model,
        "gateways": len(urls),
        "failed": len(timings) - len(ok),
        "errors": errors[:5],
        "output_tokens": out_tokens,
        "seconds": round(wall, 3),
        "output_tok_s": round(out_tokens / wall, 2),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_mean_s": client_mean,
        # The gateways' own TTFT histograms over the same burst (every gateway's /metrics, before and after).
        "gateway_ttft_mean_s": gateway_mean,
        "gateway_ttft_count": int(counted),
        "gateway_over_client_ttft": _ratio(gateway_mean, client_mean),
        "connect_first": bool(args.connect_first),
        "client_send_p50_s": percentile(sends, 50),
        "client_send_max_s": percentile(sends, 100),
        "ttft_after_send_mean_s": after_send_mean,
        "ttft_after_send_p99_s": percentile(after_send, 99),
        "gateway_over_client_ttft_after_send": _ratio(gateway_mean, after_send_mean),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "tpot_p50_s": percentile(tpots, 50),
        # Output tokens per SSE event with text: above 1 where the gateway coalesced a stream's queued deltas
        # (fewer writes, so less of its CPU per token), 1 when every token went out on its own.
        "tokens_per_event": round(out_tokens / text_events, 3) if text_events else None,
        "single_ttft_s": round(statistics.median(t.ttft or float("nan") for t in singles), 4),
    }
    if hook_failed:
        figures["burst_hook_failed"] = hook_failed
    arrivals = [t.sent for t in timings if t.sent is not None]
    return figures, arrivals if len(ok) == len(arrivals) == len(timings) else None


async def burst_hook(command: str | None, phase: str) -> int:
    """Runs `command` (a shell command) to its end with BURST_PHASE=`phase`; returns its exit status (0 without
    one). A failure does not stop the burst: it is printed, and the run's figures name the phase
    (`burst_hook_failed`), since whatever the hook measured for it is then missing."""
    if not command:
        return 0
    env = {**os.environ, "BURST_PHASE": phase}
    done = await asyncio.to_thread(subprocess.run, command, shell=True, env=env, check=False)
    if done.returncode != 0:
        print(f"kubesgl bench serve: --burst-hook ({phase}) exited {done.returncode}", file=sys.stderr)
    return done.returncode


async def _warm_up(url: str, headers: dict[str, str], model: str, ids: list[int], temperature: float) -> None:
    """One short request through `url`, retried while the stack answers 503: a gateway may list the model
    (it heard the scheduler's heartbeat) a moment before the tokenizer has, and a burst sent then fails."""
    deadline = time.monotonic() + WARM_UP_TIMEOUT_S
    while True:
        error = (await _stream(url, headers, _body(model, ids, 2, temperature))).error
        if error is None:
            return
        if not error.startswith("HTTP 503") or time.monotonic() > deadline:  # the burst will show it too
            print(f"kubesgl bench serve: warm-up through {url} failed: {error}", file=sys.stderr)
            return
        await asyncio.sleep(0.5)


def _body(model: str, ids: list[int], n: int, temperature: float) -> bytes:
    """One streamed completion's request body, JSON-encoded before any clock starts."""
    body = {
        "model": model,
        "prompt": ids,
        "max_tokens": n,
        "temperature": temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return json.dumps(body).encode()


async def _stream(
    url: str,
    headers: dict[str, str],
    body: bytes,
    origin: float | None = None,
    connection: Connection | None = None,
) -> RequestTiming:
    """One streamed completion through sse_client (httpx's pool would add its own queue to the TTFT). Its
    times count from `origin` (a perf_counter reading: the burst's start), else from this call's start."""
    timing = RequestTiming()
    start = time.perf_counter() if origin is None else origin

    def on_sent() -> None:
        timing.sent = time.perf_counter() - start

    try:
        async for data in post_events(url, "/v1/completions", body, headers, on_sent, connection):
            if data != "[DONE]":
                timing.on_event(json.loads(data), time.perf_counter() - start)
    except HttpStatusError as e:
        timing.error = str(e)
    except (OSError, asyncio.IncompleteReadError, ValueError) as e:
        timing.error = f"{type(e).__name__}: {e}"
    return timing


def _offline(
    args: argparse.Namespace, prompts: list[list[int]], max_tokens: list[int], arrivals: list[float] | None
) -> dict[str, Any]:
    """The offline LLM on the same requests, warmed on them first: all at once (its throughput and TTFT), then
    once more with each request arriving when the served one was written (`arrivals`), its TTFT counted from
    that arrival."""
    from kubesgl import LLM, SamplingParams

    llm = LLM(
        args.model,
        device=args.device,
        page_size=args.page_size,
        num_pages=args.num_pages,
        dummy_weight=args.dummy_weight,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        piecewise_cuda_graph_max_tokens=args.piecewise_cuda_graph_max_tokens,
    )
    freeze_heap()  # as the serving processes do once started (runtime.process): the same GC on both sides
    try:
        # Warm as a served engine is after an earlier burst: every prompt prefilled once (2 tokens each), then
        # the cache flushed so the timed runs find nothing of it.
        llm.generate(prompts, SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=2))
        llm.engine.flush_cache()
        params = [
            SamplingParams(temperature=args.temperature, ignore_eos=True, max_tokens=n) for n in max_tokens
        ]
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        wall = time.perf_counter() - start
        replay = []
        if arrivals is not None:
            # Fresh prompts' KV: the replay must not find the first run's prefixes cached.
            llm.engine.flush_cache()
            replay = llm.generate(prompts, params, arrivals=arrivals)
        singles = []
        for _ in range(SINGLE_TTFT_RUNS):
            t = time.perf_counter()
            llm.generate([prompts[0]], SamplingParams(temperature=args.temperature, max_tokens=1))
            singles.append(time.perf_counter() - t)
    finally:
        llm.shutdown()
    out_tokens = sum(len(o["token_ids"]) for o in outs)
    return {
        "offline_seconds": round(wall, 3),
        "offline_output_tok_s": round(out_tokens / wall, 2),
        # Every request submitted at once (offline_ttft_*), then each at its served send (offline_arrival_ttft_*:
        # None without a replay): the served TTFT p99 is judged against both.
        **_ttft_percentiles("offline_ttft", outs),
        **_ttft_percentiles("offline_arrival_ttft", replay),
        "offline_single_ttft_s": round(statistics.median(singles), 4),
    }


def _ttft_percentiles(prefix: str, outs: list[dict[str, Any]]) -> dict[str, float | None]:
    ttfts = [o["ttft_s"] for o in outs if o["ttft_s"] is not None]
    return {f"{prefix}_p50_s": percentile(ttfts, 50), f"{prefix}_p99_s": percentile(ttfts, 99)}


async def _gateway_ttft(http: httpx.AsyncClient, urls: list[str], model: str) -> tuple[float, float] | None:
    """(sum, count) of the gateways' TTFT histograms for `model`, summed over every gateway; None when one
    gateway's /metrics cannot be read (a partial sum would make the gateway/client ratio wrong, not missing)."""
    values = {"sum": 0.0, "count": 0.0}
    prefix = "kubesgl_gateway_time_to_first_token_seconds_"
    for url in urls:
        try:
            r = await http.get(f"{url}/metrics")
            r.raise_for_status()
        except httpx.HTTPError as e:
            print(f"kubesgl bench serve: {url}/metrics not read ({e}): no gateway TTFT", file=sys.stderr)
            return None
        for line in r.text.splitlines():
            for key in values:
                if line.startswith(f'{prefix}{key}{{model="{model}"}} '):
                    values[key] += float(line.rsplit(" ", 1)[1])
    return values["sum"], values["count"]


async def _first_model(http: httpx.AsyncClient, url: str) -> str:
    r = await http.get(f"{url}/v1/models")
    r.raise_for_status()
    data = r.json()["data"]
    if not data:
        raise SystemExit("kubesgl bench serve: the gateway serves no model yet")
    return data[0]["id"]


def _print(res: dict[str, Any]) -> None:
    rows = [
        ("requests (failed)", f"{res['requests']} ({res['failed']})"),
        ("gateways", res.get("gateways", 1)),
        ("prompt / output tokens", f"{res['prompt_tokens']} / {res['output_tokens']}"),
        ("output tok/s (serving)", res["output_tok_s"]),
        ("TTFT p50 / p99 (s)", f"{res['ttft_p50_s']} / {res['ttft_p99_s']}"),
    ]
    if "client_send_max_s" in res:
        rows.append(
            (
                "requests written after the burst's start p50 / max (s)",
                f"{res['client_send_p50_s']} / {res['client_send_max_s']} "
                f"({'connections opened first' if res['connect_first'] else 'each connects as it starts'})",
            )
        )
    if "gateway_ttft_mean_s" in res:
        rows.append(
            (
                "TTFT mean: client / gateway (s)",
                f"{res['ttft_mean_s']} / {res['gateway_ttft_mean_s']} ({res['gateway_over_client_ttft']})",
            )
        )
        rows.append(
            (
                "TTFT mean from the request's send: client / gateway (s)",
                f"{res['ttft_after_send_mean_s']} / {res['gateway_ttft_mean_s']} "
                f"({res['gateway_over_client_ttft_after_send']})",
            )
        )
    if "cache_hit_rate" in res:
        rows += [
            ("cache hit rate (cached / prompt tokens)", res["cache_hit_rate"]),
            (
                "TTFT p50 first / later turns (s)",
                f"{res['ttft_first_turn_p50_s']} / {res['ttft_later_turns_p50_s']}",
            ),
        ]
    if "itl_p50_s" in res:
        rows += [
            ("ITL p50 / p99 (s)", f"{res['itl_p50_s']} / {res['itl_p99_s']}"),
            ("TPOT p50 (s)", res["tpot_p50_s"]),
            ("output tokens per SSE event with text", res.get("tokens_per_event")),
            ("single-request TTFT (s)", res["single_ttft_s"]),
        ]
    if "offline_output_tok_s" in res:
        rows += [
            ("output tok/s (offline LLM)", res["offline_output_tok_s"]),
            ("serving / offline", res["serving_over_offline"]),
            (
                "TTFT p50 / p99 offline, all at once (s)",
                f"{res['offline_ttft_p50_s']} / {res['offline_ttft_p99_s']} "
                f"(served p99 / offline p99: {res['ttft_p99_over_offline']}; from each request's send: "
                f"{res['ttft_after_send_p99_over_offline']})",
            ),
            (
                "TTFT p50 / p99 offline, each request at its served send (s)",
                f"{res['offline_arrival_ttft_p50_s']} / {res['offline_arrival_ttft_p99_s']} "
                f"(served p99 from each send / this: {res['ttft_after_send_p99_over_offline_same_arrival']})",
            ),
            ("TTFT the bus adds (s)", res["bus_ttft_overhead_s"]),
        ]
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    for e in res["errors"]:
        print(f"error: {e}")
    print(json.dumps(res), flush=True)
