"""The scheduler's periodic one-line stats log, shaped like SGLang's `Decode batch.` line so an operator
watching a terminal (or `kubectl logs`) sees what the instance is doing without a Prometheus:

    Stats. #running-req: 3, #queue-req: 0, #token: 1184, token usage: 0.14, cache hit rate: 41.2%,
    gen throughput (token/s): 212.40

One line per interval while the instance is busy (a request running or queued, or tokens generated since the
last line); none while it is idle, so an idle server's log stays quiet. The rates cover the interval since the
previous line (or since the instance last became busy), from the engine's cumulative token counts.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kubesgl.values.outputs import EngineStats

log = logging.getLogger("kubesgl.scheduler.stats")


class StatsLog:
    def __init__(
        self,
        interval_s: float,
        page_size: int,
        logger: logging.Logger = log,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.interval_s = interval_s
        self._page_size = page_size
        self._log = logger
        self._clock = clock
        self._since: float | None = None  # start of the current window
        self._base: EngineStats | None = None  # the totals at its start

    def observe(self, stats: EngineStats) -> str | None:
        """Call often (every heartbeat); logs and returns a line once `interval_s` of busy time has passed."""
        if self.interval_s <= 0:
            return None
        now = self._clock()
        if self._since is None or self._base is None:
            self._since, self._base = now, stats
            return None
        busy = stats.num_running or stats.num_queued
        generated = stats.generation_tokens_total - self._base.generation_tokens_total
        if not busy and not generated:
            self._since, self._base = now, stats  # idle: the next busy window starts here
            return None
        elapsed = now - self._since
        if elapsed < self.interval_s:
            return None
        line = format_line(stats, self._base, elapsed, self._page_size)
        self._since, self._base = now, stats
        self._log.info("%s", line)
        return line


def format_line(stats: EngineStats, base: EngineStats, elapsed_s: float, page_size: int) -> str:
    """The line for the window from `base` to `stats` (`elapsed_s` long)."""
    prompt = stats.prompt_tokens_total - base.prompt_tokens_total
    cached = stats.cached_tokens_total - base.cached_tokens_total
    generated = stats.generation_tokens_total - base.generation_tokens_total
    used_tokens = (stats.total_pages - stats.available_pages) * page_size
    hit_rate = f"{100 * cached / prompt:.1f}%" if prompt > 0 else "-"  # no prefill in the window
    return (
        f"Stats. #running-req: {stats.num_running}, #queue-req: {stats.num_queued}, "
        f"#token: {used_tokens}, token usage: {stats.token_usage:.2f}, cache hit rate: {hit_rate}, "
        f"gen throughput (token/s): {generated / max(elapsed_s, 1e-9):.2f}"
    )
