"""One object per running event loop (a service process runs one loop; tests run many, one after another)."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LoopLocal(Generic[T]):
    """`get()` gives the running loop's object, made by `make()` on the loop's first call. The object must not
    keep its loop (it is the weak key: the loop would never be freed); it asks for the running loop instead."""

    def __init__(self, make: Callable[[], T]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, T] = weakref.WeakKeyDictionary()

    def get(self) -> T:
        obj = self.running()
        if obj is None:
            raise RuntimeError("no running event loop")
        return obj

    def running(self) -> T | None:
        """The running loop's object; None outside an event loop."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return None
        obj = self._by_loop.get(loop)
        if obj is None:
            obj = self._by_loop[loop] = self._make()
        return obj
