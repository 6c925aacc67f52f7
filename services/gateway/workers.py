"""`kubesgl gateway --workers N`: N gateway processes serving one port, so one pod uses N cores.

The supervisor (the process Kubernetes starts) binds N listening sockets on the port with SO_REUSEPORT, one per
worker, and spawns the workers. The kernel hashes each new connection to one of the sockets, which spreads a
burst evenly; one shared socket does not (an asyncio server accepts every queued connection when it wakes, so
the first worker awake takes most of a burst: docs/architecture.md has the figures). Each worker is a whole
gateway: its own NATS connection and reply subject (`<gateway-id>-w<i>`), scheduler registry, streams, tracing.

What the workers share, through the supervisor:
- metrics: prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set before a worker imports it),
  so whichever worker answers /metrics reports the sum over all of them (telemetry/metrics.py);
- readiness: a board of each worker's pid and readiness; /ready says 200 only while every worker is ready,
  since the kernel hands connections to all of them;
- shutdown: SIGTERM or SIGINT to the supervisor reaches every worker as one SIGTERM, and each drains its own
  streams (--drain-timeout). A worker that exits by itself stops the others and the supervisor exits 1, so
  Kubernetes restarts the pod rather than keep it with part of its capacity gone.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from dataclasses import replace
from types import FrameType
from typing import Any

from kubesgl.runtime.listen import listen_socket
from kubesgl.services.gateway.config import GatewayConfig

log = logging.getLogger("kubesgl.gateway")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


class WorkerBoard:
    """Every worker's pid and readiness, in memory the supervisor and its workers share (one writer a slot)."""

    def __init__(self, slots: Any) -> None:
        self._slots = slots  # RawArray("q", 2 * workers): pid, ready

    @classmethod
    def create(cls, ctx: multiprocessing.context.BaseContext, workers: int) -> WorkerBoard:
        return cls(ctx.RawArray("q", 2 * workers))

    @property
    def workers(self) -> int:
        return len(self._slots) // 2

    def register(self, index: int, pid: int) -> None:
        self._slots[2 * index] = pid

    def pids(self) -> dict[int, int]:
        """Worker index -> pid, for those started."""
        return {i: self._slots[2 * i] for i in range(self.workers) if self._slots[2 * i]}

    def set_ready(self, index: int, ready: bool) -> None:
        self._slots[2 * index + 1] = int(ready)

    def not_ready(self) -> list[int]:
        return [i for i in range(self.workers) if not self._slots[2 * i + 1]]


# A worker's entry point: (its config, with its socket and id; the board; its index). Module-level, for spawn.
WorkerMain = Callable[[GatewayConfig, WorkerBoard, int], None]


def supervise(config: GatewayConfig, worker_main: WorkerMain) -> int:
    """Runs `config.workers` gateway workers on one port until they exit; the exit status of the pod."""
    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: no threads or loops inherited
    sockets = _listen_sockets(config)
    metrics_dir = tempfile.mkdtemp(prefix="kubesgl-gateway-metrics-")
    os.environ[MULTIPROC_ENV] = (
        metrics_dir  # the spawned workers inherit it before importing prometheus_client
    )
    board = WorkerBoard.create(ctx, config.workers)
    procs = []
    for i, sock in enumerate(sockets):
        worker = replace(config, sock=sock, gateway_id=f"{config.gateway_id}-w{i}", workers=1)
        proc = ctx.Process(target=worker_main, args=(worker, board, i), name=f"gateway-worker-{i}")
        proc.start()
        board.register(i, proc.pid or 0)
        procs.append(proc)
    for sock in sockets:
        sock.close()  # the workers hold them now
    stopping = False

    def stop(sig: int, _frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True
        for proc in procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    failed = False
    try:
        running = list(procs)
        while running:
            multiprocessing.connection.wait([p.sentinel for p in running])
            for proc in [p for p in running if not p.is_alive()]:
                running.remove(proc)
                if not stopping:
                    log.error(
                        "gateway worker %s exited with %s: stopping the others", proc.name, proc.exitcode
                    )
                    failed = True
                    stop(signal.SIGTERM, None)
                elif proc.exitcode:
                    failed = True
    finally:
        shutil.rmtree(metrics_dir, ignore_errors=True)
    return 1 if failed else 0


def _listen_sockets(config: GatewayConfig) -> list[socket.socket]:
    """One SO_REUSEPORT socket per worker on the gateway's port: the inherited one (--fd) first, if any."""
    if config.sock is None:
        first = listen_socket(config.host, config.port, reuse_port=True)
    elif config.sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
        first = config.sock
    else:
        raise ValueError("--workers > 1 needs the socket of --fd to be bound with SO_REUSEPORT")
    host, port = first.getsockname()[:2]
    return [first, *(listen_socket(host, port, reuse_port=True) for _ in range(config.workers - 1))]
