"""Scheduler registry (liveness from heartbeats) and routers, without a bus: pure bookkeeping."""

from __future__ import annotations

import pytest
from kubesgl.protocol import Heartbeat
from kubesgl.routing import LeastLoadRouter, RoundRobinRouter, SchedulerRegistry, make_router


class FakeClockForRegistryTest:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _hb(instance: str, running: int = 0, queued: int = 0, available: int = 100, **kw: object) -> Heartbeat:
    fields = {
        "instance_id": instance, "model": "m", "context_len": 4096, "page_size": 1, "num_pages": 100,
        "running": running, "queued": queued, "free_pages": available, "available_pages": available,
        "max_running_requests": 8, "draining": False, "ts": 0.0, **kw,
    }  # fmt: skip
    return Heartbeat(**fields)  # type: ignore[arg-type]


def test_silent_instance_expires_after_three_intervals() -> None:
    clock = FakeClockForRegistryTest()
    reg = SchedulerRegistry(expiry_s=3.0, clock=clock)
    reg.observe(_hb("a"))
    reg.observe(_hb("b"))
    clock.now += 2.0
    reg.observe(_hb("b"))
    clock.now += 1.5
    assert [hb.instance_id for hb in reg.live()] == ["b"]
    clock.now += 3.1
    assert reg.live() == []


def test_gone_counts_silence_from_the_last_heartbeat_or_the_readers_start_and_sees_a_restart() -> None:
    clock, heard = FakeClockForRegistryTest(), FakeClockForRegistryTest()
    reg = SchedulerRegistry(expiry_s=3.0, clock=clock)
    reg.judge_at(heard)  # silence is judged at what the reader has read, not at the stamping clock
    reg.observe(_hb("a", kv_epoch="e1"))
    clock.now += 10.0  # the reader's wall clock runs on, but it has read nothing since
    assert not reg.gone("a")
    heard.now += 3.5
    assert reg.gone("a")
    assert not reg.gone("a", since=heard.now - 1.0)  # it began listening (or reconnected) 1 s ago
    assert not reg.gone("never-heard", since=heard.now - 1.0) and reg.gone("never-heard", since=0.0)
    heard.now = clock.now
    reg.observe(_hb("a", kv_epoch="e2"))  # alive, but another process under the same id
    assert reg.epoch("a") == "e2" and reg.epoch("never-heard") == ""
    assert reg.gone("a", epoch="e1") and not reg.gone("a", epoch="e2") and not reg.gone("a")


def test_candidates_skip_draining_and_other_models() -> None:
    reg = SchedulerRegistry()
    reg.observe(_hb("a"))
    reg.observe(_hb("b", draining=True))
    reg.observe(_hb("c", model="other"))
    assert [c.instance_id for c in reg.candidates("m")] == ["a"]
    assert {hb.instance_id for hb in reg.live()} == {"a", "b", "c"}


def test_least_load_counts_requests_routed_since_the_last_heartbeat() -> None:
    reg = SchedulerRegistry()
    reg.observe(_hb("a", running=1))
    reg.observe(_hb("b", running=2))
    router = LeastLoadRouter()
    picks = []
    for _ in range(4):
        pick = router.route([1, 2, 3], reg.candidates("m"))
        reg.note_routed(pick)
        picks.append(pick)
    assert picks == ["a", "a", "b", "a"]  # a:1->2->3, ties broken by id, b:2->3, then a
    reg.observe(_hb("a", running=0))  # a fresh heartbeat replaces the local estimate
    assert reg.candidates("m")[0].load == 0


def test_least_load_prefers_free_kv_on_equal_load() -> None:
    reg = SchedulerRegistry()
    reg.observe(_hb("a", available=10))
    reg.observe(_hb("b", available=90))
    assert LeastLoadRouter().route([], reg.candidates("m")) == "b"


def test_round_robin_takes_turns() -> None:
    reg = SchedulerRegistry()
    for name in ("b", "a", "c"):
        reg.observe(_hb(name, running=5 if name == "a" else 0))
    router = RoundRobinRouter()
    assert [router.route([], reg.candidates("m")) for _ in range(4)] == ["a", "b", "c", "a"]


def test_unknown_policy_is_refused() -> None:
    assert isinstance(make_router("round-robin"), RoundRobinRouter)
    with pytest.raises(ValueError, match="least-load"):
        make_router("random")
