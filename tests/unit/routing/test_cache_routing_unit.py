"""Cache-aware routing bookkeeping without a bus: the prefix index, staying in sync with KV event streams,
scoring overlap against load, and session affinity."""

from __future__ import annotations

from kubesgl.cache_routing.affinity import session_instance
from kubesgl.cache_routing.cache_aware import CacheAwareRouter, CacheAwareWeights
from kubesgl.cache_routing.kv_batch import KvBatch
from kubesgl.cache_routing.kv_tracker import KvTracker
from kubesgl.cache_routing.prefix_index import PrefixIndex
from kubesgl.kv.kv_events import block_hashes
from kubesgl.protocol import Heartbeat, KvEvents, KvSnapshot
from kubesgl.routing import Candidate

BS = 4


class FakeClockForRoutingTest:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hb(
    instance: str, running: int = 0, available: int = 100, seq: int = 0, epoch: str = "e1", **kw: object
) -> Heartbeat:
    fields = {
        "instance_id": instance, "model": "m", "context_len": 4096, "page_size": 1, "num_pages": 100,
        "running": running, "queued": 0, "free_pages": available, "available_pages": available,
        "max_running_requests": 10, "draining": False, "ts": 0.0, "kv_block_size": BS, "kv_epoch": epoch,
        "kv_seq": seq, **kw,
    }  # fmt: skip
    return Heartbeat(**fields)  # type: ignore[arg-type]


def _ev(
    instance: str, seq: int, stored: list[int] = (), removed: list[int] = (), epoch: str = "e1"
) -> KvEvents:  # type: ignore[assignment]
    return KvEvents(instance, epoch, seq, BS, list(stored), list(removed))


def _snap(instance: str, seq: int, blocks: list[int], epoch: str = "e1") -> KvSnapshot:
    return KvSnapshot(instance, epoch, seq, BS, list(blocks))


def _synced(tracker: KvTracker, *instances: str) -> None:
    for i in instances:
        assert tracker.on_heartbeat(_hb(i))  # first sight: wants a snapshot
        assert not tracker.on_snapshot(_snap(i, 0, []))


SYSTEM = list(range(100, 116))  # 4 blocks
CONV = SYSTEM + list(range(200, 208))  # + 2 blocks


def test_index_matches_leading_blocks_only() -> None:
    index = PrefixIndex()
    h = block_hashes(CONV, BS)
    index.store("a", h[:4])
    index.store("b", h[:2] + h[3:])  # a hole at block 2: blocks after it do not count
    assert index.matched_blocks(h, ["a", "b", "c"]) == {"a": 4, "b": 2, "c": 0}
    index.remove("a", h[1:2])
    assert index.matched_blocks(h, ["a"]) == {"a": 1}
    index.forget("b")
    assert index.instances() == ["a"] and len(index) == 3


def test_predictions_count_until_they_expire_unless_confirmed() -> None:
    clock = FakeClockForRoutingTest()
    index = PrefixIndex(predict_ttl_s=5.0, clock=clock)
    h = block_hashes(CONV, BS)
    index.predict("a", h)
    index.store("a", h[:2])  # the instance reported its first two blocks
    assert index.matched_blocks(h, ["a"]) == {"a": 6}
    clock.now += 6
    assert index.matched_blocks(h, ["a"]) == {"a": 2}
    assert index.blocks_of("a") == 2 and len(index) == 2


def test_tracker_applies_batches_in_order_and_snapshots_after_a_gap() -> None:
    tracker = KvTracker(PrefixIndex(), BS)
    _synced(tracker, "a")
    h = block_hashes(CONV, BS)
    assert not tracker.on_events(_ev("a", 1, stored=h[:4]))
    assert not tracker.on_events(_ev("a", 1, stored=h[:4]))  # duplicate ignored
    assert tracker.on_events(_ev("a", 3, stored=h[4:]))  # batch 2 lost: out of sync
    assert not tracker.fresh("a")
    # The snapshot is current to batch 2; buffered batch 3 is replayed on top of it.
    assert not tracker.on_snapshot(_snap("a", 2, h[:5]))
    assert tracker.fresh("a")
    assert tracker.index.matched_blocks(h, ["a"]) == {"a": 6}


def test_snapshot_with_a_missing_later_batch_asks_again() -> None:
    tracker = KvTracker(PrefixIndex(), BS)
    _synced(tracker, "a")
    assert tracker.on_events(_ev("a", 4, stored=[1]))
    assert tracker.on_snapshot(_snap("a", 2, [7]))  # batch 3 never came
    assert not tracker.fresh("a")


def test_heartbeat_ahead_for_a_whole_interval_means_a_lost_last_batch() -> None:
    tracker = KvTracker(PrefixIndex(), BS)
    _synced(tracker, "a")
    assert not tracker.on_heartbeat(_hb("a", seq=1))  # batch 1 may still be in flight
    assert tracker.on_heartbeat(_hb("a", seq=1))  # a whole interval later it still has not arrived
    assert not tracker.fresh("a")


def test_restart_under_the_same_id_drops_its_blocks() -> None:
    tracker = KvTracker(PrefixIndex(), BS)
    _synced(tracker, "a")
    tracker.on_events(_ev("a", 1, stored=[1, 2]))
    assert tracker.on_heartbeat(_hb("a", epoch="e2"))
    assert tracker.index.blocks_of("a") == 0 and not tracker.fresh("a")


def test_silent_instance_counts_no_overlap_and_retain_forgets_gone_ones() -> None:
    clock = FakeClockForRoutingTest()
    tracker = KvTracker(PrefixIndex(clock=clock), BS, stale_after_s=2.0, clock=clock)
    _synced(tracker, "a", "b")
    tracker.on_events(_ev("a", 1, stored=[1]))
    clock.now += 2.5
    assert not tracker.fresh("a")
    tracker.on_heartbeat(_hb("b"))
    assert tracker.fresh("b")
    assert tracker.retain(["b"]) == ["a"]
    assert tracker.index.instances() == ["b"] and tracker.index.blocks_of("a") == 0


def test_draining_or_other_block_size_is_not_tracked() -> None:
    tracker = KvTracker(PrefixIndex(), BS)
    _synced(tracker, "a")
    tracker.on_events(_ev("a", 1, stored=[1]))
    assert not tracker.on_heartbeat(_hb("a", draining=True))
    assert tracker.index.instances() == [] and not tracker.fresh("a")
    assert not tracker.on_heartbeat(_hb("b", kv_block_size=16))
    assert not tracker.fresh("b")


def _router(*instances: str, weights: CacheAwareWeights | None = None) -> CacheAwareRouter:
    tracker = KvTracker(PrefixIndex(), BS)
    _synced(tracker, *instances)
    return CacheAwareRouter(tracker, weights)


def test_router_prefers_the_instance_holding_the_prefix() -> None:
    router = _router("a", "b")
    router.tracker.on_events(_ev("b", 1, stored=block_hashes(CONV, BS)))
    d = router.decide(CONV + [9, 9, 9, 9], [Candidate(_hb("a")), Candidate(_hb("b"))])
    assert (d.instance_id, d.overlap, d.reason) == ("b", 6 / 7, "prefix")


def _pick(b_running: int, weights: CacheAwareWeights | None = None) -> str:
    router = _router("a", "b", weights=weights)
    router.tracker.on_events(_ev("b", 1, stored=block_hashes(SYSTEM, BS)))  # b holds 4 of the 6 blocks
    return router.decide(CONV, [Candidate(_hb("a")), Candidate(_hb("b", running=b_running))]).instance_id


def test_load_outweighs_a_partial_overlap() -> None:
    assert _pick(b_running=2) == "b"  # overlap 0.67 - load 0.2 beats an idle cold instance
    assert _pick(b_running=8) == "a"  # 0.67 - 0.8 does not
    assert _pick(b_running=8, weights=CacheAwareWeights(overlap=1.0, load=0.0)) == "b"


def test_out_of_sync_instance_falls_back_to_load() -> None:
    router = _router("a", "b")
    router.tracker.on_events(_ev("b", 1, stored=block_hashes(CONV, BS)))
    router.tracker.on_events(_ev("b", 3, stored=[5]))  # gap
    d = router.decide(CONV, [Candidate(_hb("a")), Candidate(_hb("b", running=1))])
    assert (d.instance_id, d.reason) == ("a", "load")


def test_a_burst_follows_its_first_request() -> None:
    router = _router("a", "b")
    cands = [Candidate(_hb("a")), Candidate(_hb("b"))]
    first = router.decide(CONV, cands).instance_id
    # Nothing was reported yet; the prediction alone keeps the burst on the first request's instance.
    assert {router.decide(CONV + [i] * 4, cands).instance_id for i in range(5)} == {first}


def test_kv_batch_keeps_the_last_word_on_each_block() -> None:
    batch = KvBatch()
    batch.add([1, 2], [3])
    batch.add([3], [1])
    assert batch.take() == ([2, 3], [1]) and not batch


def test_session_affinity_is_stable_and_moves_only_when_needed() -> None:
    cands = [Candidate(_hb(i)) for i in ("a", "b", "c")]
    picks = {s: session_instance(s, cands, max_load=1.0) for s in (f"user-{k}" for k in range(30))}
    assert set(picks.values()) == {"a", "b", "c"}  # sessions spread
    without_b = [c for c in cands if c.instance_id != "b"]
    for s, pick in picks.items():
        if pick != "b":
            assert session_instance(s, without_b, max_load=1.0) == pick  # others do not move
    s = next(s for s, pick in picks.items() if pick == "a")
    overloaded = [Candidate(_hb("a", running=10)), *cands[1:]]
    assert session_instance(s, overloaded, max_load=1.0) is None  # the policy decides instead
