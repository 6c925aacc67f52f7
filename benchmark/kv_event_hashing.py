"""Microbenchmark: KV-event hashing cost per radix-cache insert/evict for 4k-token prompts (prints, asserts nothing).

Each round caches a 4096-token prompt after prefill, then the prompt plus 64 generated tokens at release (the
scheduler's two inserts), then evicts it. The same rounds run on a cache with KV events (block size 16) and one
without, interleaved so that load on a shared box hits both alike; the difference of the medians is what hashing
costs the engine thread. "shared" prompts start with a 3584-token system prompt that stays cached (locked).

    .venv/bin/python benchmark/kv_event_hashing.py [--rounds 60] [--page-size 1]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kubesgl.kv.kv_events import KVEvents
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.radix import RadixCache

PROMPT, OUTPUT, SHARED = 4096, 64, 3584
STEPS = ("insert prompt", "insert prompt+output", "evict")


def one_round(cache: RadixCache, pool: PagePool, toks: list[int]) -> list[float]:
    ps = cache.page_size
    pages = pool.alloc(len(toks) // ps)
    t0 = time.perf_counter()
    h1, _ = cache.insert(toks[:PROMPT], pages[: PROMPT // ps])
    t1 = time.perf_counter()
    h2, _ = cache.insert(toks, pages)
    t2 = time.perf_counter()
    cache.release(h1)
    cache.release(h2)
    t3 = time.perf_counter()
    cache.evict(10**9)
    t4 = time.perf_counter()
    if cache.events is not None:
        cache.events.drain()
    return [t1 - t0, t2 - t1, t4 - t3]


def run(rounds: int, page_size: int, shared: bool) -> dict[bool, list[float]]:
    """Median microseconds of each step, with events on (True) and off (False)."""
    rng = random.Random(0)
    system = [rng.randrange(32000) for _ in range(SHARED)]
    caches = []
    for events in (True, False):
        pool = PagePool((PROMPT + OUTPUT) * 2 // page_size + 2, page_size)
        cache = RadixCache(page_size, pool, KVEvents(16) if events else None)
        if shared:
            cache.insert(system, pool.alloc(SHARED // page_size))  # held: the system prompt stays cached
        caches.append((events, cache, pool))
    times: dict[bool, list[list[float]]] = {True: [], False: []}
    for _ in range(rounds):
        head = system if shared else [rng.randrange(32000) for _ in range(SHARED)]
        toks = head + [rng.randrange(32000) for _ in range(PROMPT + OUTPUT - SHARED)]
        for events, cache, pool in caches:
            times[events].append(one_round(cache, pool, toks))
    return {e: [statistics.median(step) * 1e6 for step in zip(*t, strict=True)] for e, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--page-size", type=int, default=1)
    args = ap.parse_args()
    for shared in (False, True):
        label = f"{SHARED} shared + {PROMPT - SHARED} unique" if shared else "all unique"
        print(f"{PROMPT}-token prompt ({label}), +{OUTPUT} output, page size {args.page_size}, block 16:")
        t = run(args.rounds, args.page_size, shared)
        for i, step in enumerate(STEPS):
            on, off = t[True][i], t[False][i]
            print(f"  {step:22s} events on {on:7.0f} us  off {off:7.0f} us  hashing {on - off:7.0f} us")


if __name__ == "__main__":
    main()
