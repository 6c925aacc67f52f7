"""The shared-prefix workload of `kubesgl bench serve --workload shared-prefix`: what cache-aware routing is for.

`--groups` groups each share one long prefix (a system prompt or document of `--prefix-len` token ids); each
group has `--conversations` users holding a `--turns`-turn chat: turn t's prompt is the previous turn's prompt,
a stand-in for the assistant's reply (`--turn-output` random ids: /v1/completions streams text, not ids),
and `--turn-input` new user tokens. Conversations run concurrently (`--max-concurrency` at a time), each turn
after the previous one finished. Python `random` seeded 0, ids from randint(0, 10000); EOS ignored.

Reported besides latency and throughput: the cache hit rate, sum(cached prompt tokens) / sum(prompt tokens)
from each response's usage.prompt_tokens_details.cached_tokens, as the schedulers counted them.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kubesgl.bench.timing import RequestTiming, percentile


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--groups", type=int, default=4, help="shared-prefix: groups sharing one prefix")
    p.add_argument(
        "--prefix-len", type=int, default=1024, help="shared-prefix: tokens of each group's prefix"
    )
    p.add_argument("--conversations", type=int, default=4, help="shared-prefix: conversations per group")
    p.add_argument("--turns", type=int, default=4, help="shared-prefix: turns per conversation")
    p.add_argument("--turn-input", type=int, default=64, help="shared-prefix: new user tokens per turn")
    p.add_argument("--turn-output", type=int, default=16, help="shared-prefix: max_tokens per turn")


def make_conversations(args: argparse.Namespace) -> list[list[list[int]]]:
    """Each conversation's turns (token-id prompts), groups interleaved so no group is sent all at once."""
    rng = random.Random(0)

    def ids(n: int) -> list[int]:
        return [rng.randint(0, 10000) for _ in range(n)]

    prefixes = [ids(args.prefix_len) for _ in range(args.groups)]
    convs = []
    for _ in range(args.conversations):
        for prefix in prefixes:
            history, turns = list(prefix), []
            for _ in range(args.turns):
                prompt = history + ids(args.turn_input)
                turns.append(prompt)
                history = prompt + ids(args.turn_output)
            convs.append(turns)
    return convs


Send = Callable[[list[int], int], Awaitable[RequestTiming]]


async def run(send: Send, args: argparse.Namespace) -> dict[str, Any]:
    convs = make_conversations(args)
    gate = asyncio.Semaphore(args.max_concurrency or len(convs))

    async def converse(turns: list[list[int]]) -> list[RequestTiming]:
        out = []
        for prompt in turns:
            async with gate:
                out.append(await send(prompt, args.turn_output))
        return out

    start = time.perf_counter()
    per_conv = await asyncio.gather(*(converse(t) for t in convs))
    wall = time.perf_counter() - start
    timings = [t for conv in per_conv for t in conv]
    ok = [t for t in timings if t.error is None]
    out_tokens = sum(t.completion_tokens for t in ok)
    ttfts = [t.ttft for t in ok if t.ttft is not None]
    prompt_tokens = sum(t.prompt_tokens for t in ok)
    return {
        "workload": "shared-prefix",
        "requests": len(timings),
        "failed": len(timings) - len(ok),
        "errors": sorted({t.error for t in timings if t.error})[:5],
        "prompt_tokens": prompt_tokens,
        "cached_tokens": sum(t.cached_tokens for t in ok),
        "cache_hit_rate": round(sum(t.cached_tokens for t in ok) / max(prompt_tokens, 1), 4),
        "output_tokens": out_tokens,
        "seconds": round(wall, 3),
        "output_tok_s": round(out_tokens / wall, 2),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "ttft_first_turn_p50_s": percentile([c[0].ttft for c in per_conv if c[0].ttft is not None], 50),
        "ttft_later_turns_p50_s": percentile(
            [t.ttft for c in per_conv for t in c[1:] if t.ttft is not None], 50
        ),
    }
