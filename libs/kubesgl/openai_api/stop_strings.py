"""Stop strings applied to the decoded text stream. Text that could still turn into a stop string is held back,
so a stream never shows a partial stop string; per-delta items (logprobs) are released with their text."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class Released(Generic[T]):
    """What may be shown now: `text` and the items of the deltas that text came from."""

    text: str = ""
    items: list[T] = field(default_factory=list)


class StopStringFilter(Generic[T]):
    def __init__(self, stops: tuple[str, ...]) -> None:
        self._stops = stops
        self._pending = ""  # received, not yet released
        self._released_chars = 0
        self._received_chars = 0
        self._items: deque[tuple[int, int, list[T]]] = (
            deque()
        )  # (start, end, items) per delta, by char offset
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str, items: list[T] | None = None) -> Released[T]:
        """Feeds one delta; returns what can be released. After a stop string matched, nothing more is."""
        if self.stopped:
            return Released()
        if not self._stops:  # nothing to hold back (most streams): the delta as it came
            return Released(text, list(items or ()))
        start = self._received_chars
        self._received_chars += len(text)
        self._items.append((start, self._received_chars, list(items or ())))
        self._pending += text
        hit = self._first_stop()
        if hit is not None:
            index, stop = hit
            self.stopped, self.matched = True, stop
            out = self._release(index)
            # Deltas that contributed released text keep their items; those that only built the stop string don't.
            while self._items and self._items[0][0] < self._released_chars:
                out.items.extend(self._items.popleft()[2])
            self._items.clear()
            return out
        return self._release(len(self._pending) - self._held_suffix_len())

    def flush(self) -> Released[T]:
        """At the end of generation: everything held back is final text."""
        if self.stopped:
            return Released()
        return self._release(len(self._pending))

    def _release(self, count: int) -> Released[T]:
        text, self._pending = self._pending[:count], self._pending[count:]
        self._released_chars += count
        out = Released[T](text=text)
        while self._items and self._items[0][1] <= self._released_chars:
            out.items.extend(self._items.popleft()[2])
        return out

    def _first_stop(self) -> tuple[int, str] | None:
        hits = [(i, s) for s in self._stops if (i := self._pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _held_suffix_len(self) -> int:
        """Length of the longest suffix of the pending text that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(self._pending)), best, -1):
                if self._pending.endswith(stop[:k]):
                    best = k
                    break
        return best
