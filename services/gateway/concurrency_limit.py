"""Per-API-key concurrency limit: a request over the limit is refused at once with 429, never queued."""

from __future__ import annotations

from collections import Counter

from kubesgl.errors import RateLimitError


class Lease:
    """One admitted request's slot; release() is idempotent so every exit path may call it."""

    def __init__(self, limiter: ConcurrencyLimit, key: str) -> None:
        self._limiter, self._key, self._held = limiter, key, True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._limiter._release(self._key)


class ConcurrencyLimit:
    def __init__(self, max_per_key: int) -> None:
        self.max_per_key = max_per_key  # 0 = unlimited
        self._active: Counter[str] = Counter()

    def acquire(self, key: str) -> Lease:
        if self.max_per_key and self._active[key] >= self.max_per_key:
            raise RateLimitError(f"too many concurrent requests for this API key (limit {self.max_per_key})")
        self._active[key] += 1
        return Lease(self, key)

    def _release(self, key: str) -> None:
        self._active[key] -= 1
        if self._active[key] <= 0:
            del self._active[key]
