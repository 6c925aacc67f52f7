"""Which instances hold which prefix blocks: block hash -> instances, built from KV events and snapshots.

A hash names a whole prefix (kubesgl.kv.kv_events chains them), so an instance matches a request for as many
leading blocks of the request as it holds. Besides what instances reported, the router records what it just
sent ("predicted" blocks, which expire): the next request of a burst sharing a prefix then follows the first
one instead of landing elsewhere before the first one's prefill is reported.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence

CONFIRMED = math.inf  # the expiry of a block an instance reported (it stays until reported removed)


class PrefixIndex:
    def __init__(self, predict_ttl_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.predict_ttl_s = predict_ttl_s
        self._clock = clock
        self._holders: dict[int, dict[str, float]] = {}  # hash -> {instance: expiry}
        self._blocks: dict[str, set[int]] = {}  # instance -> hashes it holds (for forget and sizes)
        self._predicted: deque[tuple[float, str, int]] = deque()

    # -- updates ------------------------------------------------------------------------------------
    def store(self, instance: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.setdefault(instance, set())
        for h in hashes:
            self._holders.setdefault(h, {})[instance] = CONFIRMED
            mine.add(h)

    def remove(self, instance: str, hashes: Iterable[int]) -> None:
        mine = self._blocks.get(instance)
        if mine is None:
            return
        for h in hashes:
            self._drop(instance, h)
            mine.discard(h)

    def replace(self, instance: str, hashes: Iterable[int]) -> None:
        """The instance holds exactly `hashes` now (a snapshot)."""
        self.forget(instance)
        self.store(instance, hashes)

    def predict(self, instance: str, hashes: Sequence[int]) -> None:
        """The router just sent a request with these blocks to `instance`: count them as held for a while."""
        expiry = self._clock() + self.predict_ttl_s
        mine = self._blocks.setdefault(instance, set())
        for h in hashes:
            holders = self._holders.setdefault(h, {})
            if holders.get(instance) != CONFIRMED:
                holders[instance] = expiry
                mine.add(h)
                self._predicted.append((expiry, instance, h))

    def forget(self, instance: str) -> None:
        for h in self._blocks.pop(instance, ()):
            self._drop(instance, h)

    def _drop(self, instance: str, h: int) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.pop(instance, None)
            if not holders:
                del self._holders[h]

    def _expire_predictions(self) -> None:
        now = self._clock()
        while self._predicted and self._predicted[0][0] <= now:
            expiry, instance, h = self._predicted.popleft()
            if self._holders.get(h, {}).get(instance) == expiry:  # not confirmed or re-predicted since
                self._drop(instance, h)
                self._blocks.get(instance, set()).discard(h)

    # -- queries ------------------------------------------------------------------------------------
    def matched_blocks(self, hashes: Sequence[int], instances: Iterable[str]) -> dict[str, int]:
        """How many leading blocks of `hashes` each of `instances` holds."""
        self._expire_predictions()
        counts = dict.fromkeys(instances, 0)
        still = set(counts)
        for h in hashes:
            holders = self._holders.get(h)
            if not holders:
                break
            still &= holders.keys()
            if not still:
                break
            for instance in still:
                counts[instance] += 1
        return counts

    def instances(self) -> list[str]:
        return list(self._blocks)

    def blocks_of(self, instance: str) -> int:
        return len(self._blocks.get(instance, ()))

    def __len__(self) -> int:
        """Distinct blocks held anywhere."""
        return len(self._holders)
