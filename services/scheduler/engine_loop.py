"""The engine thread: owns the Engine and runs its blocking step loop, fed by commands from the event loop.

NATS lives in asyncio on the main thread; the engine's compute blocks, so it runs here. The only ways in are
commands on a thread-safe queue (add, abort, stats, KV snapshot, stop); the only ways out are the callbacks given
at construction, which the service makes thread-safe (loop.call_soon_threadsafe). Nothing here blocks on NATS.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kubesgl.engine.engine import Engine
from kubesgl.errors import KubesglError
from kubesgl.kv.radix import RadixCache
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.values.outputs import EngineStats, ModelInfo, RequestOutput
from kubesgl.values.sampling import SamplingParams

log = logging.getLogger("kubesgl.scheduler.engine")

_IDLE_WAIT_S = 0.05
_STATS_EVERY_S = 0.1
_PULL_POLL_S = 0.0005


@dataclass(frozen=True)
class AddRequest:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    done: Callable[[KubesglError | None], None]  # None = admitted
    output_ids: list[int] = field(default_factory=list)  # a resume admission: output that already exists


@dataclass(frozen=True)
class AbortRequest:
    rid: str


@dataclass(frozen=True)
class QueryStats:
    done: Callable[[EngineStats], None]


@dataclass(frozen=True)
class KvSnapshotQuery:
    """Every block the prefix cache holds, after handing over the KV events drained so far."""

    done: Callable[[list[int]], None]


@dataclass(frozen=True)
class StopEngine:
    pass


@dataclass(frozen=True)
class RunOnEngine:
    """Work of a role hook (pd.py) that must run on the engine thread; what it returns is reported."""

    fn: Callable[[Engine], list[RequestOutput]]


class StepHook(Protocol):
    """A disaggregation role's per-step work on the engine thread (services/scheduler/pd.py)."""

    @property
    def busy(self) -> bool: ...  # work pending outside the engine (KV pulls): the loop keeps turning

    def loaded(self, engine: Engine, telemetry: SchedulerTelemetry) -> None: ...  # before it announces itself

    def after_step(self, engine: Engine, outputs: list[RequestOutput]) -> list[RequestOutput]: ...

    def abort(self, engine: Engine, rid: str) -> None: ...


Command = AddRequest | AbortRequest | QueryStats | KvSnapshotQuery | StopEngine | RunOnEngine


class EngineLoop:
    """Runs `make_engine()` and then its step loop on a dedicated thread."""

    def __init__(
        self,
        make_engine: Callable[[], Engine],
        make_telemetry: Callable[[ModelInfo], SchedulerTelemetry],
        on_loaded: Callable[[ModelInfo], None],
        on_outputs: Callable[[list[RequestOutput], dict[str, str | None]], None],
        on_fatal: Callable[[BaseException], None],
        on_kv_events: Callable[[list[int], list[int]], None] | None = None,
        hook: StepHook | None = None,
    ) -> None:
        self.hook = hook
        self._make_engine = make_engine
        self._make_telemetry = make_telemetry
        self.telemetry: SchedulerTelemetry | None = None  # set once the model is loaded (it names the pool)
        self._on_loaded = on_loaded
        self._on_outputs = on_outputs
        self._on_fatal = on_fatal
        self._on_kv_events = on_kv_events
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.stats: EngineStats | None = (
            None  # latest snapshot, replaced whole (safe to read from any thread)
        )

    def start(self) -> None:
        self._thread.start()

    def submit(self, command: Command) -> None:
        self._commands.put(command)

    def stop(self, timeout_s: float) -> None:
        """Stops the loop after the commands already queued, and shuts the engine (and its TP ranks) down."""
        self._commands.put(StopEngine())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.error("engine thread did not stop within %.0f s", timeout_s)

    def _run(self) -> None:
        try:
            engine = self._make_engine()
        except BaseException as e:
            log.exception("engine failed to load")
            self._on_fatal(e)
            return
        try:
            self.telemetry = self._make_telemetry(engine.info)
            if self.hook is not None:
                self.hook.loaded(engine, self.telemetry)
            self.stats = engine.stats()
            self._on_loaded(engine.info)
            self._loop(engine, self.telemetry)
        except BaseException as e:
            log.exception("engine loop failed")
            self._on_fatal(e)
        finally:
            engine.shutdown()

    def _loop(self, engine: Engine, telemetry: SchedulerTelemetry) -> None:
        next_stats = 0.0
        hook = self.hook
        while True:
            pulling = hook is not None and hook.busy
            for command in self._take(block=not (engine.has_work() or pulling)):
                if isinstance(command, StopEngine):
                    return
                self._apply(engine, command)
            if pulling and not engine.has_work():
                time.sleep(_PULL_POLL_S)  # a KV pull in flight and nothing to step: poll it without spinning
            outputs: list[RequestOutput] = []
            if engine.has_work():
                telemetry.on_step_start()
                outputs = engine.step()
            if hook is not None:
                outputs = hook.after_step(engine, outputs)
            if outputs:
                self._on_outputs(outputs, telemetry.on_outputs(outputs))
            self._hand_over_kv_events(engine)
            if (now := time.monotonic()) >= next_stats:
                self.stats, next_stats = engine.stats(), now + _STATS_EVERY_S

    def _take(self, block: bool) -> list[Command]:
        commands: list[Command] = []
        try:
            commands.append(
                self._commands.get(timeout=_IDLE_WAIT_S) if block else self._commands.get_nowait()
            )
            while True:
                commands.append(self._commands.get_nowait())
        except queue.Empty:
            return commands

    def _apply(self, engine: Engine, command: Command) -> None:
        if isinstance(command, AddRequest):
            try:
                engine.add_request(command.rid, command.input_ids, command.params, command.output_ids)
            except KubesglError as e:
                command.done(e)
            else:
                command.done(None)
        elif isinstance(command, AbortRequest):
            engine.abort(command.rid)
            if self.hook is not None:
                self.hook.abort(engine, command.rid)
        elif isinstance(command, RunOnEngine):
            if outputs := command.fn(engine):
                assert self.telemetry is not None
                self._on_outputs(outputs, self.telemetry.on_outputs(outputs))
        elif isinstance(command, QueryStats):
            command.done(engine.stats())
        elif isinstance(command, KvSnapshotQuery):
            self._hand_over_kv_events(engine)  # first, so the snapshot is exactly "as of" these events
            cache, events = engine.cache, engine.kv_events
            ok = isinstance(cache, RadixCache) and events is not None
            command.done(cache.block_hashes(events.block_size) if ok else [])

    def _hand_over_kv_events(self, engine: Engine) -> None:
        if self._on_kv_events is not None:
            stored, removed = engine.drain_kv_events()  # two list swaps when nothing changed
            if stored or removed:
                self._on_kv_events(stored, removed)
