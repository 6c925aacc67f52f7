"""KV events: the radix cache reports the prefix blocks it gains and loses, by a hash any process can recompute."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from kubesgl import LLM, SamplingParams
from kubesgl.kv.kv_events import KVEvents, block_hashes
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.radix import RadixCache
from kubesgl.models.random_init import build_random_model


def test_block_hashes_chain_whole_prefixes() -> None:
    a = block_hashes(list(range(40)), 16)
    assert len(a) == 2
    assert block_hashes(list(range(32)) + [99] * 8, 16) == a  # only full blocks count
    b = block_hashes([7] + list(range(1, 40)), 16)
    assert b[0] != a[0] and b[1] != a[1]  # a change in block 0 changes every later hash
    assert block_hashes(list(range(40)), 16, start_block=1, parent=a[0]) == a[1:]


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_insert_and_evict_emit_block_events(page_size: int) -> None:
    pool = PagePool(100, page_size)
    ev = KVEvents(block_size=8)
    cache = RadixCache(page_size, pool, ev)
    toks = [random.Random(0).randrange(1000) for _ in range(36)]
    n_pages = 36 // page_size
    handle, _ = cache.insert(toks, pool.alloc(n_pages))
    stored, removed = ev.drain()
    assert stored == block_hashes(toks, 8) and removed == []
    # A second sequence sharing 20 tokens adds only the blocks past the shared part.
    other = toks[:20] + [5] * 12
    h2, _ = cache.insert(other, pool.alloc(32 // page_size))
    stored, _ = ev.drain()
    assert stored == block_hashes(other, 8)[20 // 8 :]
    cache.release(handle)
    cache.release(h2)
    cache.evict(10_000)
    _, removed = ev.drain()
    assert set(removed) == set(block_hashes(toks, 8)) | set(block_hashes(other, 8))


def test_engine_reports_events_for_finished_requests(tmp_path) -> None:
    model = build_random_model("qwen3", tmp_path / "m", init_std=0.5)
    prompt = [random.Random(1).randrange(500) for _ in range(50)]
    with LLM(str(model), kv_event_block_size=16) as llm:
        out = llm.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
        stored, removed = llm.engine.drain_kv_events()
    full = prompt + out["token_ids"]
    # Every full block of the prompt is reported; later blocks only where their KV exists.
    assert block_hashes(prompt, 16) == stored[: len(prompt) // 16]
    assert set(stored) <= set(block_hashes(full, 16)) and removed == []


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_block_hashes_equal_the_net_event_stream(page_size: int) -> None:
    """A snapshot lists exactly the blocks that the events so far stored and did not remove."""
    rng = random.Random(page_size)
    pool = PagePool(400, page_size)
    ev = KVEvents(block_size=8)
    cache = RadixCache(page_size, pool, ev)
    held: set[int] = set()
    shared = [rng.randrange(50) for _ in range(24)]
    for _ in range(30):
        toks = shared[: rng.randrange(0, 25)] + [rng.randrange(50) for _ in range(rng.randrange(1, 40))]
        toks = toks[: len(toks) - len(toks) % page_size]
        if not toks:
            continue
        if pool.num_free < len(toks) // page_size:
            cache.evict(len(toks))
        handle, _ = cache.insert(toks, pool.alloc(len(toks) // page_size))
        cache.release(handle)
        if rng.random() < 0.3:
            cache.evict(rng.randrange(1, 20))
        stored, removed = ev.drain()
        held = (held - set(removed)) | set(stored)
        snapshot = cache.block_hashes(8)
        assert len(snapshot) == len(set(snapshot)) and set(snapshot) == held


def _cached_blocks(cache: RadixCache, seqs: list[list[int]], block_size: int) -> set[int]:
    """From scratch: the block hashes of the part of each sequence the cache still holds."""
    out: set[int] = set()
    for s in seqs:
        handle, pages = cache.match_prefix(s)
        cache.release(handle)
        out |= set(block_hashes(s[: len(pages) * cache.page_size], block_size))
    return out


@pytest.mark.parametrize("page_size", [1, 3, 4, 8, 16])
def test_split_keeps_each_half_its_own_hashes(page_size: int) -> None:
    """A page cut that is not a block boundary: the block it crosses goes with its last token, so evicting the
    lower half reports exactly its blocks and a new branch under the upper half chains from the right hash."""
    pool = PagePool(200, page_size)
    ev = KVEvents(block_size=8)
    cache = RadixCache(page_size, pool, ev)
    rng = random.Random(page_size)
    a = [rng.randrange(1000) for _ in range(48)]
    cut = -(-12 // page_size) * page_size  # the first page boundary at or past 12 tokens
    b = a[:cut] + [rng.randrange(1000, 2000) for _ in range(48 - cut)]
    cache.release(cache.insert(a, pool.alloc(48 // page_size))[0])
    ev.drain()
    cache.release(cache.insert(b, pool.alloc(48 // page_size))[0])  # splits a's edge at `cut`
    assert ev.drain() == (block_hashes(b, 8)[cut // 8 :], [])
    assert cache.evict(1) == (48 - cut) // page_size  # a's lower half, the least recently used leaf
    assert ev.drain() == ([], block_hashes(a, 8)[cut // 8 :])
    cache.release(cache.insert(a, pool.alloc(48 // page_size))[0])  # hangs off the upper half again
    assert ev.drain() == (block_hashes(a, 8)[cut // 8 :], [])
    # A lookup that stops inside an edge splits it too. a's lower half starts mid-block (at 12 unless pages are
    # 8 or 16 tokens) and is cut past the next block boundary, so its upper part owns that block.
    deep = -(-24 // page_size) * page_size
    cache.release(cache.match_prefix(a[:deep] + [-1] * page_size)[0])
    cache.evict(1)  # b's lower half, the least recently used leaf now
    assert ev.drain() == ([], block_hashes(b, 8)[cut // 8 :])
    assert cache.evict(1) == (48 - deep) // page_size  # the part of a below the lookup's split
    assert ev.drain() == ([], block_hashes(a, 8)[deep // 8 :])
    cache.release(cache.insert(a, pool.alloc(48 // page_size))[0])
    assert ev.drain() == (block_hashes(a, 8)[deep // 8 :], [])
    assert sorted(cache.block_hashes(8)) == sorted(block_hashes(a, 8))
    cache.evict(10_000)
    stored, removed = ev.drain()
    assert stored == [] and sorted(removed) == sorted(block_hashes(a, 8))


@pytest.mark.parametrize("page_size", [1, 3, 8, 16])
def test_cached_hashes_match_from_scratch_hashes_through_splits_and_evictions(page_size: int) -> None:
    """Random inserts, lookups (which split edges) and evictions of sequences sharing prefixes: after each, the
    events' net blocks equal the snapshot's, copy for copy, and the blocks hashed from scratch from what is cached.

    When a page is longer than a block or not a multiple of it, two sibling edges can both hold the block that
    ends inside their first page, so a block may be held (and stored) twice; events are counted, not a set."""
    rng = random.Random(100 + page_size)
    pool = PagePool(160 // page_size + 2, page_size)
    ev = KVEvents(block_size=8)
    cache = RadixCache(page_size, pool, ev)
    stems = [[rng.randrange(1000) for _ in range(64)] for _ in range(3)]
    seqs: list[list[int]] = []
    held: Counter[int] = Counter()
    for _ in range(60):
        op = rng.random()
        stem = stems[rng.randrange(3)]  # shared prefixes that part at any depth: edges split anywhere
        toks = stem[: rng.randrange(64)] + [rng.randrange(3) for _ in range(rng.randrange(page_size, 24))]
        toks = toks[: len(toks) - len(toks) % page_size]
        if op < 0.5 and toks:
            if pool.num_free < len(toks) // page_size:
                cache.evict(len(toks) // page_size - pool.num_free)
            cache.release(cache.insert(toks, pool.alloc(len(toks) // page_size))[0])
            seqs.append(toks)
        elif op < 0.8:
            cache.release(cache.match_prefix(toks)[0])
        else:
            cache.evict(rng.randrange(1, 30))
        stored, removed = ev.drain()
        held.update(stored)
        held.subtract(removed)
        snapshot = cache.block_hashes(8)
        assert min(held.values(), default=0) >= 0 and +held == Counter(snapshot)
        assert set(snapshot) == _cached_blocks(cache, seqs, 8)
        if 8 % page_size == 0:
            assert len(snapshot) == len(set(snapshot))


def test_snapshot_needs_the_events_block_size() -> None:
    pool = PagePool(10, 1)
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        RadixCache(1, pool, KVEvents(block_size=8)).block_hashes(16)
    with pytest.raises(ValueError, match="no KV events"):
        RadixCache(1, pool).block_hashes(8)
