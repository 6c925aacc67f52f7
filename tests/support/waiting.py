"""Waiting for an event in tests: poll a condition until it holds, or fail naming what never happened.

A test waits for the event that decides its outcome, never for a fixed time: on a busy 2-core machine any fixed
sleep is either too short (a flaky failure) or too long (a slow suite). The polling interval only bounds the
latency of noticing the event; the timeout only bounds how long a broken run hangs.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(predicate: Callable[[], T], what: str, timeout_s: float = 10.0, interval_s: float = 0.05) -> T:
    """Calls `predicate` until it returns a truthy value, and returns that value; fails after `timeout_s`."""
    end = time.monotonic() + timeout_s
    while not (value := predicate()):
        assert time.monotonic() < end, f"timed out after {timeout_s:g} s waiting until {what}"
        time.sleep(interval_s)
    return value


async def wait_until_async(
    predicate: Callable[[], T | Awaitable[T]], what: str, timeout_s: float = 10.0, interval_s: float = 0.01
) -> T:
    """Like wait_until, inside an event loop; `predicate` may be a coroutine function (an HTTP probe)."""
    end = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        assert time.monotonic() < end, f"timed out after {timeout_s:g} s waiting until {what}"
        await asyncio.sleep(interval_s)
