"""Process lifecycle shared by the bus services: logging setup, stop-on-signal, and tracking handler tasks
so a graceful shutdown can wait for the work it already accepted."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Coroutine
from typing import Any

log = logging.getLogger("kubesgl.runtime.lifecycle")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def stop_on_signals() -> asyncio.Event:
    """An event set by the first SIGTERM or SIGINT (Kubernetes stops a pod with SIGTERM)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _on_signal, sig, stop)
    return stop


def _on_signal(sig: signal.Signals, stop: asyncio.Event) -> None:
    log.info("%s received: shutting down gracefully", sig.name)
    stop.set()


class TaskGroup:
    """Handler tasks running concurrently (a NATS callback must return fast) that shutdown waits for."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("handler failed", exc_info=task.exception())

    async def wait(self, timeout: float) -> None:
        """Waits up to `timeout` for every task, then cancels the rest."""
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:
                task.cancel()
