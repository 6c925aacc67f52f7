"""A serving run's step timeline (KUBESGL_STEP_LOG=path): one JSON line per launched engine step, to read after
the fact where the time between a request's arrival and its first token went.

Each line: `t` (time.time() at the step's start, seconds), `mode` (extend, decode, mixed), `rows`, `tokens`
(the step's new tokens: prefill chunks plus one per decode row), `schedule_ms` and `launch_ms` (host time to
plan and to launch it), and the scheduler's state after planning: `waiting`, `running`, `free_pages`,
`cached_pages` (the prefix cache, evictable or not). With overlap scheduling a step's device time shows as the
gap to the next line's `t`. The file is line-buffered: each step's line is on disk once the step is launched,
so an engine that is killed keeps its timeline (a few µs per step, and only while the variable is set).
"""

from __future__ import annotations

import json
import time

from kubesgl.engine.plan import BatchPlan
from kubesgl.engine.scheduler.scheduler import Scheduler
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import PrefixCache


class StepLog:
    """A StepHook (engine/step_profile.py) that writes an engine's step timeline to `path` (appending)."""

    def __init__(self, path: str, scheduler: Scheduler, pool: PagePool, cache: PrefixCache) -> None:
        # Open for the engine's life (closed with the process): line-buffered, nothing to flush or close.
        self._file = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        self._scheduler, self._pool, self._cache = scheduler, pool, cache
        self._wall = self._start = self._planned = 0.0

    def step_started(self) -> None:
        self._wall, self._start = time.time(), time.perf_counter()

    def scheduled(self, plan: BatchPlan) -> None:
        self._planned = time.perf_counter()

    def launched(self, plan: BatchPlan) -> None:
        now = time.perf_counter()
        mode = "mixed" if plan.mode == "extend" and plan.num_decode else plan.mode
        tokens = len(plan.slots) if plan.mode == "decode" else sum(plan.extend_lens)
        line = {
            "t": round(self._wall, 6),
            "mode": mode,
            "rows": len(plan.slots),
            "tokens": tokens,
            "schedule_ms": round((self._planned - self._start) * 1e3, 3),
            "launch_ms": round((now - self._planned) * 1e3, 3),
            "waiting": len(self._scheduler.waiting),
            "running": len(self._scheduler.running),
            "free_pages": self._pool.num_free,
            "cached_pages": self._cache.cached_pages,
        }
        self._file.write(json.dumps(line) + "\n")

    def read_back(self, plan: BatchPlan) -> None:
        pass

    def processed(self, plan: BatchPlan) -> None:
        pass
