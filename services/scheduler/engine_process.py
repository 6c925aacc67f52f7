"""The engine in a process of its own: the scheduler's bus work (NATS, admissions, deltas, heartbeats, KV
events) stays in the service process, so the engine's Python runs on a GIL nothing else takes.

The service process (rank 0's NATS side) spawns one engine process per instance and talks to it over one
multiprocessing pipe (a Unix socket pair; pickled tuples, as SGLang's scheduler <-> tokenizer ZMQ IPC sends
pickled objects). EngineProcess below has EngineLoop's interface, so SchedulerService does not know which one
it drives. Inside the engine process the ordinary EngineLoop thread steps the engine; the process's main thread
only moves commands from the pipe to it and sends the latest stats snapshot on.

Messages, service -> engine: ("add", token, rid, input_ids, params, output_ids) | ("abort", rid) | ("stats", token) |
("kv_snapshot", token) | ("stop",). Engine -> service: ("loaded", info, stats) | ("outputs", outputs,
step_start_ns) | ("kv", stored, removed) | ("stats", stats) | ("done", token, result) | ("fatal", error).
Per-request telemetry (spans, latency histograms) stays in the service process: the engine sends when each
step began, which is all the spans need from it.

Either side's death takes the other down: the engine process ends when its pipe reaches EOF (the service
process died), and the service process treats an engine process that exits unasked as a failed engine (it
fails in-flight requests and exits 1), so a pod is never half alive.
"""

from __future__ import annotations

import itertools
import logging
import multiprocessing
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.connection import wait as mp_wait
from typing import Any

from kubesgl.engine.engine import Engine
from kubesgl.runtime.lifecycle import configure_logging
from kubesgl.runtime.process import freeze_heap
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.services.scheduler.engine_loop import (
    AbortRequest,
    AddRequest,
    Command,
    EngineLoop,
    KvSnapshotQuery,
    QueryStats,
    StopEngine,
)
from kubesgl.values.outputs import ModelInfo, RequestOutput

log = logging.getLogger("kubesgl.scheduler.engine")

_STATS_POLL_S = 0.05  # how often the engine process's main thread looks for a new stats snapshot to send


class EngineProcessError(RuntimeError):
    """The engine process failed or exited unasked."""


class EngineProcess:
    """EngineLoop's interface over an engine running in a spawned process (see the module docstring)."""

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        make_telemetry: Callable[[ModelInfo], SchedulerTelemetry],
        on_loaded: Callable[[ModelInfo], None],
        on_outputs: Callable[[list[RequestOutput], dict[str, str | None]], None],
        on_fatal: Callable[[BaseException], None],
        on_kv_events: Callable[[list[int], list[int]], None] | None = None,
        log_level: str = "info",
    ) -> None:
        self._make_engine = make_engine  # pickled into the engine process: a module-level callable or partial
        self._make_telemetry = make_telemetry
        self.telemetry: SchedulerTelemetry | None = None
        self.stats: Any = None
        self._on_loaded = on_loaded
        self._on_outputs = on_outputs
        self._on_fatal = on_fatal
        self._on_kv_events = on_kv_events
        self._log_level = log_level
        self._tokens = itertools.count()
        self._pending: dict[int, Callable[[Any], None]] = {}
        self._send_lock = threading.Lock()
        self._stopping = False
        self._failed = False
        ctx = multiprocessing.get_context("spawn")  # no fork: the service process has threads and a loop
        self._conn, child = ctx.Pipe(duplex=True)
        self._child_conn: Connection | None = child
        self._proc = ctx.Process(
            target=run_engine_process,
            args=(child, make_engine, log_level, on_kv_events is not None),
            name="kubesgl-engine",
            daemon=False,  # the engine spawns its TP ranks; a daemon process may not have children
        )
        self._reader = threading.Thread(target=self._read, name="engine-pipe", daemon=True)

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    def start(self) -> None:
        self._proc.start()
        assert self._child_conn is not None
        self._child_conn.close()  # only the engine process holds that end: its exit is our EOF
        self._child_conn = None
        log.info("engine process started (pid %d)", self._proc.pid)
        self._reader.start()

    def submit(self, command: Command) -> None:
        if isinstance(command, AddRequest):
            token = self._expect(command.done)
            self._send(("add", token, command.rid, command.input_ids, command.params, command.output_ids))
        elif isinstance(command, AbortRequest):
            self._send(("abort", command.rid))
        elif isinstance(command, QueryStats):
            self._send(("stats", self._expect(command.done)))
        elif isinstance(command, KvSnapshotQuery):
            self._send(("kv_snapshot", self._expect(command.done)))
        elif isinstance(command, StopEngine):
            self._send(("stop",))

    def stop(self, timeout_s: float) -> None:
        """Stops the engine after the commands already sent and waits for its process to exit."""
        self._stopping = True
        self._send(("stop",))
        start = time.monotonic()
        self._proc.join(timeout_s)
        if not self._exited():
            waited = time.monotonic() - start
            log.error(
                "engine process still running %.1f s after stop (limit %.0f s); killing it", waited, timeout_s
            )
            self._proc.kill()
            self._proc.join(5.0)
        self._reader.join(5.0)

    def _exited(self) -> bool:
        """Whether the engine process has ended. Its sentinel (a pipe only it holds open) says so even where its
        exit status is gone: with SIGCHLD ignored, or a library in this process reaping children, waitpid
        answers ECHILD and multiprocessing keeps calling the ended process alive (seen on the GPU box: every
        stop logged a hang and killed a process that had exited)."""
        return self._proc.exitcode is not None or bool(mp_wait([self._proc.sentinel], 0))

    def _expect(self, done: Callable[[Any], None]) -> int:
        token = next(self._tokens)
        self._pending[token] = done
        return token

    def _send(self, message: tuple[Any, ...]) -> None:
        try:
            with self._send_lock:
                self._conn.send(message)
        except (OSError, EOFError, ValueError):  # the engine process is gone; the reader reports it
            if not self._stopping:
                log.warning("engine process unreachable; dropped %s", message[0])

    def _read(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            try:
                self._handle(message)
            except Exception as e:  # a message we cannot act on is a broken engine boundary: fail loudly
                log.exception("engine process message %r failed", message[0])
                self._fail(e)
        self._proc.join(5.0)
        if not self._stopping:
            self._fail(
                EngineProcessError(
                    f"the engine process (pid {self._proc.pid}) exited with code {self._proc.exitcode}"
                )
            )

    def _handle(self, message: tuple[Any, ...]) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, step_start_ns = message
            assert self.telemetry is not None
            self._on_outputs(outputs, self.telemetry.on_outputs(outputs, step_start_ns))
        elif kind == "stats":
            self.stats = message[1]
        elif kind == "done":
            self._pending.pop(message[1])(message[2])
        elif kind == "kv":
            if self._on_kv_events is not None:
                self._on_kv_events(message[1], message[2])
        elif kind == "loaded":
            _, info, stats = message
            self.telemetry = self._make_telemetry(info)
            self.stats = stats
            self._on_loaded(info)
        elif kind == "fatal":
            self._fail(message[1])

    def _fail(self, error: BaseException) -> None:
        if not self._failed:
            self._failed = True
            self._on_fatal(error)


class _StepClock:
    """The engine process's side of the telemetry: when each step began (the service process has the rest)."""

    def __init__(self) -> None:
        self.step_start_ns = 0

    def on_step_start(self) -> None:
        self.step_start_ns = time.time_ns()

    def on_outputs(self, outputs: list[RequestOutput]) -> dict[str, str | None]:
        return {}


def run_engine_process(
    conn: Connection, make_engine: Callable[[], Engine], log_level: str, kv_events: bool
) -> None:
    """The engine process's entry: an EngineLoop thread fed from the pipe until "stop" or EOF."""
    configure_logging(log_level)
    # Shutdown is the service process's to order (drain first): a SIGTERM or Ctrl-C sent to the whole
    # process group must not stop the engine under requests still being drained.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    lock = threading.Lock()
    clock = _StepClock()

    def send(message: tuple[Any, ...]) -> None:
        try:
            with lock:
                conn.send(message)
        except (OSError, EOFError):
            pass  # the service process is gone; the main thread sees EOF and stops the engine

    def loaded(info: ModelInfo) -> None:
        freeze_heap()  # this process is the engine's: its startup objects leave the collector's view
        send(("loaded", info, loop.stats))

    def outputs(outs: list[RequestOutput], _parents: dict[str, str | None]) -> None:
        send(("outputs", outs, clock.step_start_ns))

    def fatal(error: BaseException) -> None:
        try:
            send(("fatal", error))
        except Exception:  # an exception that does not pickle still ends the engine, by name
            send(("fatal", EngineProcessError(f"{type(error).__name__}: {error}")))

    def reply(token: int) -> Callable[[Any], None]:
        return lambda result: send(("done", token, result))

    loop = EngineLoop(
        make_engine,
        lambda _info: clock,  # type: ignore[arg-type,return-value]
        loaded,
        outputs,
        fatal,
        (lambda stored, removed: send(("kv", stored, removed))) if kv_events else None,
    )
    loop.start()
    last_stats = loop.stats
    while True:
        try:
            ready = conn.poll(_STATS_POLL_S)
            message = conn.recv() if ready else None
        except (EOFError, OSError):
            log.error("the scheduler's service process is gone; stopping the engine")
            break
        if message is not None:
            kind = message[0]
            if kind == "stop":
                break
            if kind == "add":
                _, token, rid, input_ids, params, output_ids = message
                loop.submit(AddRequest(rid, input_ids, params, reply(token), output_ids))
            elif kind == "abort":
                loop.submit(AbortRequest(message[1]))
            elif kind == "stats":
                loop.submit(QueryStats(reply(message[1])))
            elif kind == "kv_snapshot":
                loop.submit(KvSnapshotQuery(reply(message[1])))
        if loop.stats is not last_stats and loop.stats is not None:
            last_stats = loop.stats
            send(("stats", last_stats))
    loop.stop(60.0)
    conn.close()
