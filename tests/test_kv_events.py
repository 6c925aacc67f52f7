"""KV events: the radix cache reports the prefix blocks it gains and loses, by a hash any process can recompute."""

from __future__ import annotations

import random

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
