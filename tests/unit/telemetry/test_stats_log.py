"""The scheduler's periodic stats line (SGLang's `Decode batch.` line): one per interval while busy, with the
interval's throughput and cache hit rate from the engine's token totals; silent while idle; off at 0."""

from __future__ import annotations

import logging

import pytest
from kubesgl.runtime.telemetry.stats_log import StatsLog
from kubesgl.values.outputs import EngineStats


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def stats(running: int = 0, queued: int = 0, prompt: int = 0, cached: int = 0, generated: int = 0,
          available: int = 100) -> EngineStats:  # fmt: skip
    return EngineStats(
        num_running=running,
        num_queued=queued,
        free_pages=available,
        available_pages=available,
        total_pages=100,
        cached_prefix_pages=0,
        prompt_tokens_total=prompt,
        cached_tokens_total=cached,
        generation_tokens_total=generated,
    )


@pytest.fixture
def clock() -> Clock:
    return Clock()


def test_a_busy_instance_logs_one_line_per_interval_with_its_rates(clock, caplog) -> None:
    log = StatsLog(10.0, page_size=16, clock=clock)
    caplog.set_level(logging.INFO, logger="kubesgl.scheduler.stats")
    assert log.observe(stats()) is None  # the first sample only starts the window
    clock.now += 5
    assert log.observe(stats(running=2, prompt=100, cached=40, generated=50, available=90)) is None
    clock.now += 5
    line = log.observe(stats(running=3, queued=1, prompt=200, cached=50, generated=400, available=75))
    assert line == (
        "Stats. #running-req: 3, #queue-req: 1, #token: 400, token usage: 0.25, cache hit rate: 25.0%, "
        "gen throughput (token/s): 40.00"
    )
    assert [r.getMessage() for r in caplog.records] == [line]
    clock.now += 10  # the next window starts at the last line: only its own tokens count
    line = log.observe(stats(running=3, prompt=200, cached=50, generated=500, available=75))
    assert line is not None and line.endswith("cache hit rate: -, gen throughput (token/s): 10.00")


def test_an_idle_instance_logs_nothing_and_a_new_burst_is_timed_from_its_start(clock) -> None:
    log = StatsLog(10.0, page_size=1, clock=clock)
    log.observe(stats())
    for _ in range(30):
        clock.now += 1
        assert log.observe(stats()) is None
    clock.now += 10
    line = log.observe(stats(running=1, prompt=10, generated=100))
    # The idle minute before the burst is not in the rate: the window began at the last idle sample.
    assert line is not None and line.endswith("gen throughput (token/s): 10.00")
    clock.now += 10
    line = log.observe(stats(prompt=10, generated=150))  # finished within the interval: one last line
    assert line is not None and "#running-req: 0" in line
    clock.now += 10
    assert log.observe(stats(prompt=10, generated=150)) is None


def test_interval_zero_turns_it_off(clock) -> None:
    log = StatsLog(0.0, page_size=1, clock=clock)
    for _ in range(3):
        clock.now += 100
        assert log.observe(stats(running=1, generated=int(clock.now))) is None
