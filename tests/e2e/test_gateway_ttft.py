"""The gateway's TTFT histogram times what its clients see: from the request's arrival (before its body is read
and parsed) to the first chunk with text, not from the route's start. Driven over a real stack (nats-server +
every service its own process, the demo model) with a burst of concurrent streams, whose parse, tokenize and
admission queues are what a route-started clock would miss. Two gateways, so `kubesgl bench serve` over both
is checked too (its streams spread round-robin, its gateway TTFT summed over both /metrics)."""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from conftest import TEST_SCHEDULER_ARGS
from kubesgl.bench import serve as bench_serve
from kubesgl.bench.sse_client import post_events
from kubesgl.launcher import Stack

STREAMS = 48
PROMPT_TOKENS = 200
MAX_TOKENS = 4
# Admitted in waves of 3, so the burst queues at the scheduler as at a loaded GPU: the TTFT is mostly the
# server's own waiting, not the client's send of 48 requests (which the gateway cannot see).
RUNNING = 3
SLOW_BODY_S = 0.3
_TTFT = "kubesgl_gateway_time_to_first_token_seconds"


@pytest.fixture(scope="module")
def served(stack_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(
        tmp_path_factory.mktemp("ttft"),
        gateways=2,
        scheduler_args=(*TEST_SCHEDULER_ARGS, "--max-running-requests", str(RUNNING)),
        env={"OMP_NUM_THREADS": "1"},  # a core left for the client, gateway and NATS on a 2-core runner
    )
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


def gateway_ttft(http: httpx.Client) -> tuple[float, float]:
    """(sum, count) of the gateway's TTFT histogram for the demo model."""
    text = http.get("/metrics").text

    def sample(name: str) -> float:
        match = re.search(rf'^{name}{{model="demo"}} (\S+)$', text, re.MULTILINE)
        return float(match.group(1)) if match else 0.0

    return sample(f"{_TTFT}_sum"), sample(f"{_TTFT}_count")


async def client_ttfts(url: str, prompts: list[list[int]]) -> list[float]:
    """Each stream's TTFT as its client sees it: from the moment its request is written to the socket to the
    first text chunk. The clock starts once the request is sent, not before the connect: on a 2-core runner the
    client's own event loop, opening 48 connections in turn, is what delays the later sends (up to ~0.2 s in
    clean-clone runs), and no server clock can see a request before it is sent."""

    async def one(ids: list[int]) -> float:
        body = {"model": "demo", "prompt": ids, "max_tokens": MAX_TOKENS, "stream": True}
        body |= {"temperature": 0, "ignore_eos": True}
        sent: list[float] = []
        first = None
        async for data in post_events(
            url, "/v1/completions", body, on_sent=lambda: sent.append(time.perf_counter())
        ):
            if first is None and data != "[DONE]" and any(c.get("text") for c in json.loads(data)["choices"]):
                first = time.perf_counter() - sent[0]
        assert first is not None, "the stream sent no text"
        return first

    return list(await asyncio.gather(*(one(p) for p in prompts)))


def test_gateway_ttft_agrees_with_the_clients_under_a_burst(served: Stack) -> None:
    url = served.gateway_urls[0]
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 10_000) for _ in range(PROMPT_TOKENS)] for _ in range(STREAMS)]
    with httpx.Client(base_url=url, timeout=30) as http:
        asyncio.run(client_ttfts(url, prompts[:2]))  # warm-up: first-request costs are not what this pins
        sum0, count0 = gateway_ttft(http)
        clients = asyncio.run(client_ttfts(url, prompts))
        sum1, count1 = gateway_ttft(http)
    assert count1 - count0 == STREAMS
    gateway_mean, client_mean = (sum1 - sum0) / STREAMS, sum(clients) / STREAMS
    # The client's clock also holds its own connect, send and its event loop's turn among 48 streams: the
    # gateway's may be lower by that, which on a 2-core CI runner shared with another test worker reached 81 ms
    # of a 0.71 s mean (one clean-clone run). Within 10 %, or 0.1 s where the mean is under a second; never above
    # the client's (the gateway cannot see the first chunk after the client does).
    assert client_mean - gateway_mean <= max(0.1 * client_mean, 0.1), (gateway_mean, client_mean)
    assert gateway_mean <= 1.02 * client_mean, (gateway_mean, client_mean)


def test_gateway_ttft_counts_the_time_its_body_takes_to_arrive(served: Stack) -> None:
    """The clock starts when the headers arrive, not once the body is read and parsed."""
    url = served.gateway_urls[0]
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "demo", "prompt": [101, 102, 103], "max_tokens": 2, "stream": True}).encode()

    async def slow_upload() -> float:
        reader, writer = await asyncio.open_connection(host, int(port))
        start = time.perf_counter()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        writer.write(f"{head}Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        await asyncio.sleep(SLOW_BODY_S)  # scenario timing: the slow body under test
        writer.write(body)
        response = await reader.read()  # Connection: close: the whole stream, until the server closes
        writer.close()
        assert response.startswith(b"HTTP/1.1 200") and b"[DONE]" in response, response[:200]
        return time.perf_counter() - start

    with httpx.Client(base_url=url, timeout=30) as http:
        sum0, count0 = gateway_ttft(http)
        whole = asyncio.run(slow_upload())
        sum1, count1 = gateway_ttft(http)
    assert count1 - count0 == 1
    assert SLOW_BODY_S <= sum1 - sum0 <= whole


def test_bench_serve_spreads_its_streams_over_every_gateway_and_sums_their_ttft(
    served: Stack, capsys
) -> None:
    urls = served.gateway_urls
    assert len(urls) == 2

    def per_gateway() -> list[tuple[float, float]]:
        out = []
        for u in urls:
            with httpx.Client(base_url=u, timeout=30) as http:
                out.append(gateway_ttft(http))
        return out

    before = per_gateway()
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    # Each stream connects as it starts here (the default opens the burst's connections first: test_gateway_e2e).
    flags = ["--url", ",".join(urls), "--num-seqs", "6", "--max-input", "32", "--min-output", "2"]
    flags.append("--no-connect-first")
    assert bench_serve.main(parser.parse_args([*flags, "--max-output", "4"])) == 0
    after = per_gateway()
    res = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert res["gateways"] == 2 and res["failed"] == 0 and res["connect_first"] is False
    # Each gateway: one warm-up and its half of the burst; the single-request runs go to the first.
    served_by = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    assert served_by == [1 + 3 + bench_serve.SINGLE_TTFT_RUNS, 1 + 3], served_by
    # The burst's TTFT is summed over both gateways' histograms (one gateway's would count 3).
    assert res["gateway_ttft_count"] == 6 and res["gateway_over_client_ttft"] is not None
