"""Live scheduler instances as their heartbeats announce them; an instance silent for a few intervals is gone.
The gateway reads it to list models, answer /ready, refuse work no one can serve, and fail requests whose
scheduler vanished."""

from __future__ import annotations

import time
from collections.abc import Callable

from kubesgl.protocol import HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES_TO_EXPIRE, Heartbeat


class SchedulerRegistry:
    def __init__(
        self,
        expire_after_s: float = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES_TO_EXPIRE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._expire_after_s = expire_after_s
        self._clock = clock
        # Receipt time, not the heartbeat's own ts: the two hosts' clocks need not agree.
        self._last: dict[str, tuple[float, Heartbeat]] = {}

    def observe(self, hb: Heartbeat) -> None:
        self._last[hb.instance_id] = (self._clock(), hb)

    def live(self) -> list[Heartbeat]:
        now = self._clock()
        for instance, (seen, _) in list(self._last.items()):
            if now - seen > self._expire_after_s * 100:
                del self._last[instance]  # long gone: keep memory bounded
        return [hb for seen, hb in self._last.values() if now - seen <= self._expire_after_s]

    def is_gone(self, instance_id: str, connected_since: float) -> bool:
        """True when `instance_id` missed its heartbeats while we were connected to NATS long enough to have
        heard them (`connected_since`, on this registry's clock: after a reconnect we wait again)."""
        now = self._clock()
        if now - connected_since <= self._expire_after_s:
            return False
        seen = self._last.get(instance_id)
        return seen is None or now - seen[0] > self._expire_after_s

    def models(self) -> dict[str, int]:
        """Served model names with their context length (the smallest, should instances disagree)."""
        out: dict[str, int] = {}
        for hb in self.live():
            out[hb.model] = min(out.get(hb.model, hb.context_len), hb.context_len)
        return out

    def accepting(self, model: str) -> list[Heartbeat]:
        """Instances of `model` taking new work (live and not draining)."""
        return [hb for hb in self.live() if hb.model == model and not hb.draining]
