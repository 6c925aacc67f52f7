"""The scheduler's process boundary (engine_process.py): the engine in a spawned process of its own, driven
through EngineProcess as SchedulerService drives it. The engine inside is a FAKE (FakeEngine below: the model
is not what these tests are about); the pipe, the engine process's EngineLoop and the service-side telemetry
are the real ones."""

from __future__ import annotations

import functools
import os
import queue
import signal
import subprocess
import sys
import threading
from collections import deque

import psutil
import pytest
from kubesgl.errors import InvalidRequestError, KubesglError
from kubesgl.runtime.telemetry.metrics import SchedulerMetrics, new_registry
from kubesgl.runtime.telemetry.scheduler import SchedulerTelemetry
from kubesgl.runtime.telemetry.tracing import Tracing
from kubesgl.services.scheduler.engine_loop import AbortRequest, AddRequest, QueryStats
from kubesgl.services.scheduler.engine_process import EngineProcess, EngineProcessError
from kubesgl.values.outputs import EngineStats, FinishReason, ModelInfo, RequestOutput
from kubesgl.values.sampling import SamplingParams

INFO = ModelInfo("fake", "Qwen3ForCausalLM", 4096, 32000, (2,), 16, 1000)
WAIT_S = 60.0  # only a broken boundary waits this long: a spawned interpreter starts in a second or two


class FakeEngine:
    """A FAKE engine: each step gives every running request one token derived from its prompt and position (a
    resume admission's `output_ids` are the positions already generated);
    rid "bad" is refused at admission, rid "crash" kills the process at the next step (exit code 3)."""

    def __init__(self, seed: int) -> None:
        self.info = INFO
        self.cache = None
        self.kv_events = None
        self._seed = seed
        self._running: dict[str, list[int]] = {}  # rid -> [prompt sum, emitted, max tokens, prompt len]
        self._order: deque[str] = deque()

    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams, output_ids=()) -> None:
        if rid == "bad":
            raise InvalidRequestError("the fake refuses this request", param="max_tokens")
        self._running[rid] = [sum(input_ids), len(output_ids), params.max_tokens or 1_000_000, len(input_ids)]

    def abort(self, rid: str) -> None:
        self._running.pop(rid, None)

    def has_work(self) -> bool:
        return bool(self._running)

    def step(self) -> list[RequestOutput]:
        if "crash" in self._running:
            os._exit(3)
        outputs = []
        for rid, r in list(self._running.items()):
            r[1] += 1
            done = r[1] >= r[2]
            token = (r[0] * 31 + r[1] * 7919 + self._seed) % INFO.vocab_size
            reason = FinishReason.LENGTH if done else None
            outputs.append(RequestOutput(rid, [token], r[3], 0, r[1], done, reason))
            if done:
                del self._running[rid]
        return outputs

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        return [], []

    def stats(self) -> EngineStats:
        return EngineStats(len(self._running), 0, INFO.num_pages, INFO.num_pages, INFO.num_pages, 0)

    def shutdown(self) -> None:
        pass


class Side:
    """The service side's callbacks, recorded."""

    def __init__(self, seed: int) -> None:
        self.loaded = threading.Event()
        self.outputs: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()
        self.fatal: queue.SimpleQueue[BaseException] = queue.SimpleQueue()
        registry = new_registry()
        self.engine = EngineProcess(
            functools.partial(FakeEngine, seed),
            lambda info: SchedulerTelemetry(
                SchedulerMetrics(registry, "demo", info.page_size, info.num_pages),
                Tracing("test"),
                "i",
                "demo",
            ),
            lambda info: self.loaded.set(),
            lambda outs, parents: [self.outputs.put(o) for o in outs],
            self.fatal.put,
            log_level="warning",
        )

    def __enter__(self) -> Side:
        self.engine.start()
        assert self.loaded.wait(WAIT_S), "the engine process never reported its model loaded"
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.stop(WAIT_S)

    def add(
        self, rid: str, input_ids: list[int], max_tokens: int | None, output_ids: list[int] | None = None
    ) -> KubesglError | None:
        result: queue.SimpleQueue[KubesglError | None] = queue.SimpleQueue()
        params = SamplingParams(max_tokens=max_tokens)
        self.engine.submit(AddRequest(rid, input_ids, params, result.put, output_ids or []))
        return result.get(timeout=WAIT_S)

    def stats(self) -> EngineStats:
        result: queue.SimpleQueue[EngineStats] = queue.SimpleQueue()
        self.engine.submit(QueryStats(result.put))
        return result.get(timeout=WAIT_S)


def test_outputs_cross_the_pipe_unchanged() -> None:
    seed = 20261205
    local = FakeEngine(seed)
    local.add_request("a", [5, 6, 7], SamplingParams(max_tokens=9))
    expected = [out for _ in range(9) for out in local.step()]
    with Side(seed) as side:
        assert side.add("a", [5, 6, 7], 9) is None
        got = [side.outputs.get(timeout=WAIT_S) for _ in expected]
        assert got == expected
        assert side.engine.telemetry is not None  # made on the service side from the engine's ModelInfo


def test_a_resume_admission_crosses_with_its_output_so_far() -> None:
    """A migrated request's output_ids reach the engine: it continues where the dead instance stopped."""
    seed = 20261206
    local = FakeEngine(seed)
    local.add_request("a", [5, 6, 7], SamplingParams(max_tokens=9))
    expected = [out for _ in range(9) for out in local.step()]
    with Side(seed) as side:
        done = [t for out in expected[:4] for t in out.new_token_ids]
        assert side.add("a", [5, 6, 7], 9, done) is None
        got = [side.outputs.get(timeout=WAIT_S) for _ in expected[4:]]
        assert got == expected[4:]


def test_a_refused_admission_crosses_with_its_error() -> None:
    with Side(1) as side:
        err = side.add("bad", [1], 4)
        assert isinstance(err, InvalidRequestError)
        assert (str(err), err.param) == ("the fake refuses this request", "max_tokens")


def test_an_abort_crosses_the_pipe() -> None:
    with Side(2) as side:
        assert side.add("long", [1, 2], None) is None
        first = side.outputs.get(timeout=WAIT_S)
        assert first.rid == "long" and not first.finished
        assert side.stats().num_running == 1
        side.engine.submit(AbortRequest("long"))
        assert side.stats().num_running == 0  # the stats query is answered after the abort is applied
        assert side.fatal.empty()


def test_the_engine_process_dying_fails_the_service_side_clearly() -> None:
    with Side(3) as side:
        assert side.add("crash", [1], 4) is None
        err = side.fatal.get(timeout=WAIT_S)
        assert isinstance(err, EngineProcessError)
        assert f"(pid {side.engine.pid}) exited with code 3" in str(err)
        assert side.fatal.empty()  # reported once


def test_the_engine_process_stops_when_the_service_process_is_gone() -> None:
    """A service process that dies at once (os._exit, as SIGKILL would) leaves no engine process behind."""
    script = (
        "import os, sys, test_engine_process as t\n"
        "side = t.Side(4).__enter__()\n"
        "print(side.engine.pid, flush=True)\n"
        "os._exit(9)\n"
    )
    here = os.path.dirname(os.path.abspath(__file__))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, *sys.path])}
    service = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=WAIT_S
    )
    assert service.returncode == 9, service.stderr
    try:
        engine = psutil.Process(int(service.stdout.split()[0]))
    except psutil.NoSuchProcess:
        return  # already gone
    engine.wait(WAIT_S)  # raises psutil.TimeoutExpired while the orphaned engine process lives on


def test_a_stop_sees_the_engine_process_exit_even_when_another_reaper_took_its_status(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """With SIGCHLD ignored (or a library reaping children: seen on the GPU box), waitpid answers ECHILD and
    multiprocessing reports the exited engine process as alive; stop must not call that a hang and kill it."""
    with Side(5) as side:
        pid = side.engine.pid
        previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the child itself
        try:
            with caplog.at_level("WARNING", logger="kubesgl.scheduler.engine"):
                side.engine.stop(WAIT_S)
        finally:
            signal.signal(signal.SIGCHLD, previous)
        assert not psutil.pid_exists(pid)
        assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
