"""Which scheduler instance serves a request: a registry of live instances built from heartbeats, and routers.

A router sees the request's tokens and the live, non-draining candidates, and names one instance. The token
ids are part of the interface so a cache-aware router (prefix overlap with each instance's radix cache) plugs
in without changing callers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from kubesgl.protocol import HEARTBEAT_INTERVAL_S, HEARTBEAT_MISSES_TO_EXPIRE, Heartbeat


@dataclass(frozen=True)
class Candidate:
    """A live instance as the router sees it: its last heartbeat plus requests routed to it since then."""

    heartbeat: Heartbeat
    routed_since_heartbeat: int = 0

    @property
    def instance_id(self) -> str:
        return self.heartbeat.instance_id

    @property
    def load(self) -> int:
        hb = self.heartbeat
        return hb.running + hb.queued + self.routed_since_heartbeat


def disaggregated(candidates: Sequence[Candidate]) -> tuple[list[Candidate], list[Candidate]] | None:
    """(decode instances, prefill instances) when both roles are live; None otherwise, and then every
    candidate takes requests end to end (a prefill instance alone serves whole requests rather than none)."""
    decode = [c for c in candidates if c.heartbeat.role == "decode"]
    prefill = [c for c in candidates if c.heartbeat.role == "prefill"]
    return (decode, prefill) if decode and prefill else None


class Router(Protocol):
    def route(self, request_tokens: Sequence[int], candidates: Sequence[Candidate]) -> str:
        """The instance id to send the request to; `candidates` is never empty."""
        ...


class LeastLoadRouter:
    """Fewest running + queued requests (counting ones routed since the last heartbeat), then most free KV."""

    def route(self, request_tokens: Sequence[int], candidates: Sequence[Candidate]) -> str:
        best = min(candidates, key=lambda c: (c.load, -c.heartbeat.available_pages, c.instance_id))
        return best.instance_id


class RoundRobinRouter:
    """Each instance in turn (by id order), regardless of load or cache contents."""

    def __init__(self) -> None:
        self._turn = itertools.count()

    def route(self, request_tokens: Sequence[int], candidates: Sequence[Candidate]) -> str:
        ordered = sorted(candidates, key=lambda c: c.instance_id)
        return ordered[next(self._turn) % len(ordered)].instance_id


ROUTERS: dict[str, Callable[[], Router]] = {
    "least-load": LeastLoadRouter,
    "round-robin": RoundRobinRouter,
}


def make_router(policy: str) -> Router:
    try:
        return ROUTERS[policy]()
    except KeyError:
        raise ValueError(f"unknown routing policy {policy!r}; choose from {sorted(ROUTERS)}") from None


class SchedulerRegistry:
    """Live scheduler instances from their heartbeats; one silent for `expiry_s` is dropped."""

    def __init__(
        self,
        expiry_s: float = HEARTBEAT_INTERVAL_S * HEARTBEAT_MISSES_TO_EXPIRE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock` stamps each heartbeat as it is read, and judges silence until judge_at gives another."""
        self.expiry_s = expiry_s
        self._clock = clock
        self._heard = clock
        self._seen: dict[str, tuple[Heartbeat, float]] = {}
        self._routed: dict[str, int] = {}

    def judge_at(self, heard: Callable[[], float]) -> None:
        """Judges silence at `heard` from now on: the time up to which the reading service has read everything
        sent to it (runtime.heard_clock), so a reader that fell behind does not take its own lag for its
        peers' death."""
        self._heard = heard

    def observe(self, hb: Heartbeat) -> None:
        self._seen[hb.instance_id] = (hb, self._clock())
        self._routed[hb.instance_id] = 0

    def gone(self, instance_id: str, epoch: str = "", since: float = float("-inf")) -> bool:
        """Dead to this reader: no heartbeat for the expiry, counted (at the judging clock) from its last one, or
        from `since` if that is later or none came (when the reader began to listen, or last reconnected:
        silence before that says nothing); or heartbeating under another process epoch than `epoch` ("" =
        unknown): a restart under the same id, which knows nothing of the old process's requests. Reads one
        entry and changes nothing, so another thread may ask while the event loop records heartbeats."""
        seen = self._seen.get(instance_id)
        last = since if seen is None else max(since, seen[1])
        if self._heard() - last > self.expiry_s:
            return True
        return seen is not None and bool(epoch and seen[0].kv_epoch and seen[0].kv_epoch != epoch)

    def epoch(self, instance_id: str) -> str:
        """The instance's process epoch (Heartbeat.kv_epoch) as last heard; "" when unknown or not published."""
        seen = self._seen.get(instance_id)
        return seen[0].kv_epoch if seen is not None else ""

    def note_routed(self, instance_id: str) -> None:
        """Counts a request sent to `instance_id`, so a burst between heartbeats does not pile onto one."""
        self._routed[instance_id] = self._routed.get(instance_id, 0) + 1

    def forget(self, instance_id: str) -> None:
        self._seen.pop(instance_id, None)
        self._routed.pop(instance_id, None)

    def live(self) -> list[Heartbeat]:
        """Instances heard from within the expiry window (draining ones included); expired ones are dropped."""
        now = self._heard()
        for iid in [i for i, (_, seen) in self._seen.items() if now - seen > self.expiry_s]:
            self.forget(iid)
        return [hb for hb, _ in self._seen.values()]

    def candidates(self, model: str) -> list[Candidate]:
        """Live, non-draining instances serving `model`, ready for a Router."""
        return [
            Candidate(hb, self._routed.get(hb.instance_id, 0))
            for hb in self.live()
            if hb.model == model and not hb.draining
        ]
