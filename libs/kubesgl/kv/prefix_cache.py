"""The prefix-cache interface (radix or naive) the scheduler talks to."""

from __future__ import annotations

from typing import Protocol


class CacheHandle(Protocol):
    """A lock on a cached prefix (from match_prefix or insert), opaque to all but the cache that made it."""


class PrefixCache(Protocol):
    """Maps token prefixes to KV pages it owns. Handles are opaque per-request locks."""

    def match_prefix(self, tokens: list[int]) -> tuple[CacheHandle | None, list[int]]:
        """Longest cached page-aligned prefix of `tokens`: (handle, pages). The handle is locked."""
        ...

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[CacheHandle | None, list[int]]:
        """Caches `pages` (page-aligned KV of `tokens`); returns a locked handle and the canonical pages for
        `tokens`. Pages of the caller that duplicate cached ones are freed by the cache."""
        ...

    def release(self, handle: CacheHandle | None) -> None:
        """Unlocks a handle from match_prefix/insert."""
        ...

    def evict(self, num_pages: int) -> int:
        """Frees up to `num_pages` unreferenced pages back to the pool; returns how many."""
        ...

    @property
    def evictable_pages(self) -> int: ...

    @property
    def cached_pages(self) -> int: ...


class NaiveCache:
    """No reuse: nothing is ever cached."""

    def __init__(self, page_size: int, pool: object) -> None:
        self.page_size = page_size

    def match_prefix(self, tokens: list[int]) -> tuple[CacheHandle | None, list[int]]:
        return None, []

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[CacheHandle | None, list[int]]:
        return None, []

    def release(self, handle: CacheHandle | None) -> None:
        pass

    def evict(self, num_pages: int) -> int:
        return 0

    @property
    def evictable_pages(self) -> int:
        return 0

    @property
    def cached_pages(self) -> int:
        return 0
