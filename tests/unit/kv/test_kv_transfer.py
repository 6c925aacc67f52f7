"""The KV pull's description and descriptors (kv/kv_transfer.py): a request's pages travel as the prefill cache's
layout plus page ids, and the decode side reads them in regions that cover whole stretches consecutive on both
sides. The last tests move real pages between two caches through real NIXL agents (UCX over host memory)."""

from __future__ import annotations

import random
import time

import pytest
import torch
from kubesgl.kv.kv_cache import KVCache
from kubesgl.kv.kv_transfer import KvTransferAgent, TransferState, decode_pages, encode_pages, joint_runs
from kubesgl.kv.page_pool import PagePool


def _expand(runs: list[tuple[int, int]]) -> list[int]:
    return [first + k for first, count in runs for k in range(count)]


def test_joint_runs_split_where_either_side_breaks() -> None:
    a = [5, 6, 7, 8, 20, 21, 3]
    b = [10, 11, 30, 31, 32, 33, 34]
    runs_a, runs_b = joint_runs(a, b)
    assert runs_a == [(5, 2), (7, 2), (20, 2), (3, 1)]
    assert runs_b == [(10, 2), (30, 2), (32, 2), (34, 1)]
    assert joint_runs(list(range(100, 612)), list(range(1, 513))) == ([(100, 512)], [(1, 512)])
    assert joint_runs([], []) == ([], [])


def test_joint_runs_cover_both_lists_with_maximal_runs() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randrange(1, 60)
        start = rng.randrange(50)
        a = rng.sample(range(200), n) if rng.random() < 0.5 else list(range(start, start + n))
        b = sorted(rng.sample(range(200), n)) if rng.random() < 0.5 else list(range(3, 3 + n))
        runs_a, runs_b = joint_runs(a, b)
        assert _expand(runs_a) == a and _expand(runs_b) == b
        assert [c for _, c in runs_a] == [c for _, c in runs_b]
        ends = [sum(c for _, c in runs_a[: i + 1]) for i in range(len(runs_a) - 1)]
        for e in ends:  # a run ends only where one side stops counting up
            assert a[e] != a[e - 1] + 1 or b[e] != b[e - 1] + 1


def test_a_description_round_trips_and_garbage_is_refused() -> None:
    kv = KVCache(3, 40, 4, 2, 8, torch.float32, "cpu")
    pages = [7, 8, 9, 1, 39]
    layout, got = decode_pages(encode_pages(kv.layout(), pages))
    assert (layout, got) == (kv.layout(), pages)
    assert layout.run_regions([(7, 3)])[0] == (kv.buffers()[0][0, 7].data_ptr(), 3 * kv.page_bytes)
    assert layout.run_regions([(1, 1)])[-1] == (kv.buffers()[1][2, 1].data_ptr(), kv.page_bytes)
    for bad in (b"", b"KVP1", b"XXXX" + bytes(40), encode_pages(kv.layout(), pages) + b"\x00"):
        with pytest.raises(ValueError, match="not a KV page description"):
            decode_pages(bad)


def _pull(src: KVCache, dst: KVCache, src_pages: list[int], dst_pages: list[int]) -> None:
    pytest.importorskip("nixl_cu12", reason="NIXL (the disagg extra) is not installed")
    p, d = KvTransferAgent("p-kv-test", src), KvTransferAgent("d-kv-test", dst)
    try:
        tid = d.read(p.metadata(), p.describe(src_pages), dst_pages)
        deadline = time.monotonic() + 30
        while (state := d.poll(tid)) is TransferState.RUNNING:
            assert time.monotonic() < deadline, "the pull did not finish in 30 s"
        assert state is TransferState.DONE
    finally:
        d.close()
        p.close()


def test_pages_land_where_the_decode_side_put_them() -> None:
    """Scattered and consecutive pages on both sides, pools of different sizes: every layer's K and V of each
    described page arrives in its paired page, and no other page changes."""
    gen = torch.Generator().manual_seed(3)
    src = KVCache(3, 64, 4, 2, 8, torch.float32, "cpu")
    dst = KVCache(3, 50, 4, 2, 8, torch.float32, "cpu")
    for buf in src.buffers():
        buf.copy_(torch.randn(buf.shape, generator=gen))
    src_pages = [10, 11, 12, 13, 40, 41, 5, 6, 7, 63]
    dst_pages = [1, 2, 30, 31, 32, 33, 34, 8, 9, 49]
    assert len(joint_runs(src_pages, dst_pages)[0]) == 6
    _pull(src, dst, src_pages, dst_pages)
    untouched = torch.ones(dst.num_pages, dtype=torch.bool)
    untouched[dst_pages] = False
    for s, d in zip(src.buffers(), dst.buffers(), strict=True):
        assert torch.equal(d[:, dst_pages], s[:, src_pages])
        assert not d[:, untouched].any()


def test_a_description_of_another_geometry_is_refused() -> None:
    pytest.importorskip("nixl_cu12", reason="NIXL (the disagg extra) is not installed")
    src = KVCache(3, 16, 4, 2, 8, torch.float32, "cpu")
    dst = KVCache(3, 16, 8, 2, 8, torch.float32, "cpu")  # another page size
    p, d, d2 = (KvTransferAgent(n, kv) for n, kv in (("p-geo", src), ("d-geo", dst), ("d2-geo", src)))
    try:
        with pytest.raises(ValueError, match="KV geometry"):
            d.read(p.metadata(), p.describe([1, 2]), [3, 4])
        with pytest.raises(ValueError, match="2 pages described, 1 to fill"):
            d2.read(p.metadata(), p.describe([1, 2]), [3])
    finally:
        for agent in (d2, d, p):
            agent.close()


def test_a_reused_pool_hands_out_consecutive_pages_ascending() -> None:
    """What keeps a pull to a few regions on a busy pool: freed pages come back in their order. Before, a freed
    request's pages came back descending, so every later pull of that length was one region per page."""
    pool = PagePool(4097, 16)
    first = pool.alloc(2048)
    assert first == list(range(1, 2049))
    pool.free(first)
    again = pool.alloc(2048)
    assert again == first
    assert len(joint_runs(again, pool.alloc(2048))[0]) == 1  # both sides reused or fresh: one stretch
    pool.free(again[:100])
    pool.free(again[1000:1100])
    mixed = pool.alloc(200)
    assert mixed == again[1000:1100] + again[:100]  # the last freed first, each stretch ascending
    assert len(joint_runs(mixed, list(range(5000, 5200)))[0]) == 2
