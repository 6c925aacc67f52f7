"""One object per running event loop (a gateway process runs one loop; tests run many, one after another)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopLocal(Generic[T]):
    """`get()` gives the running loop's object, made by `make(loop)` on the loop's first call."""

    def __init__(self, make: Callable[[asyncio.AbstractEventLoop], T]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()

    def get(self) -> T:
        loop = asyncio.get_running_loop()
        obj = self._by_loop.get(loop)
        if obj is None:
            obj = self._by_loop[loop] = self._make(loop)
        return obj
