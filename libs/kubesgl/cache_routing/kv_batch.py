"""The net effect of KV events not yet published: blocks stored and blocks removed, kept disjoint."""

from __future__ import annotations

from collections.abc import Iterable


class KvBatch:
    """Coalesces successive (stored, removed) drains; a later event about a block overrides an earlier one."""

    def __init__(self) -> None:
        self.stored: set[int] = set()
        self.removed: set[int] = set()

    def add(self, stored: Iterable[int], removed: Iterable[int]) -> None:
        stored, removed = set(stored), set(removed)
        self.stored = (self.stored - removed) | stored
        self.removed = (self.removed - stored) | removed

    def __bool__(self) -> bool:
        return bool(self.stored or self.removed)

    def take(self) -> tuple[list[int], list[int]]:
        """The batch as (stored, removed) lists, leaving this one empty."""
        out = sorted(self.stored), sorted(self.removed)
        self.stored, self.removed = set(), set()
        return out
