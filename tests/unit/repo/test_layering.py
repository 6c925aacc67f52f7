"""The import graph keeps to the declared layers (kubesgl.tools.imports.LAYERS): no cycle, no arrow up, and the
engine library imports nothing of NATS, HTTP, metrics or the wire. The checker itself is shown failing on
planted packages. Inside the engine, the device side never imports the scheduler, and no file outgrows one
reader's sitting."""

from __future__ import annotations

from pathlib import Path

import kubesgl.tool_formats as tool_formats
import pytest
from kubesgl.tools.imports import check, import_graph, kubesgl_roots

PLANTED_LAYERS = (("pkg.low",), ("pkg.high",), ("pkg",))


def _plant(tmp_path: Path, files: dict[str, str]) -> list[str]:
    root = tmp_path / "pkg"
    for name, source in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    graph = import_graph({"pkg": root})
    return check(graph, PLANTED_LAYERS, library=("pkg.low",), forbidden=("nats", "pkg.high"))


def test_kubesgl_imports_keep_to_the_layers() -> None:
    graph = import_graph(kubesgl_roots())
    assert len(graph.files) > 100  # the walk saw the library and the services
    assert "kubesgl.services.scheduler.service" in graph.files
    assert check(graph) == []


# The device side of the engine: it executes plans and returns step results, and knows nothing of how the
# scheduler chose them (the plan and the step tokens, engine/plan.py, are all the two share).
DEVICE_SIDE = (
    "kubesgl.engine.runner",
    "kubesgl.engine.step_result",
    "kubesgl.engine.sampler",
    "kubesgl.engine.cuda_graph",
    "kubesgl.engine.distributed",
)
ENGINE_MAX_LINES = 400


def test_the_device_side_of_the_engine_never_imports_the_scheduler() -> None:
    graph = import_graph(kubesgl_roots())
    assert "kubesgl.engine.scheduler.planner" in graph.files  # the scheduler is a package of rooms
    arrows = [
        f"{module} imports {imp.target} (line {imp.line})"
        for module in DEVICE_SIDE
        for imp in graph.imports[module]
        if imp.target == "kubesgl.engine.scheduler" or imp.target.startswith("kubesgl.engine.scheduler.")
    ]
    assert arrows == []


def test_no_engine_file_is_over_400_lines() -> None:
    graph = import_graph(kubesgl_roots())
    engine = {
        m: p for m, p in graph.files.items() if m == "kubesgl.engine" or m.startswith("kubesgl.engine.")
    }
    assert len(engine) > 15
    long = {m: n for m, p in engine.items() if (n := len(p.read_text().splitlines())) > ENGINE_MAX_LINES}
    assert long == {}


def test_a_cycle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    problems = _plant(
        tmp_path,
        {
            "high/__init__.py": "",
            "high/a.py": "from pkg.high import b\n",
            "high/b.py": "def f():\n    from pkg.high.a import x\n",
        },
    )
    assert problems == ["import cycle: pkg.high.a -> pkg.high.b -> pkg.high.a"]


def test_an_arrow_up_and_a_forbidden_import_are_found(tmp_path: Path) -> None:
    problems = _plant(
        tmp_path,
        {
            "low/__init__.py": "",
            "low/m.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import nats.aio\n",
            "low/n.py": "from ..high import h\n",
            "high/__init__.py": "",
            "high/h.py": "from pkg.low import n\n",
        },
    )
    assert "pkg.low.m (line 3): the library imports nats" in problems
    assert "pkg.low.n (line 1): imports pkg.high.h, a floor above (pkg.high over pkg.low)" in problems
    assert "pkg.low.n (line 1): the library imports pkg.high.h" in problems
    assert "import cycle: pkg.high.h -> pkg.low.n -> pkg.high.h" in problems


def test_a_package_cycle_without_a_module_cycle_is_found(tmp_path: Path) -> None:
    layers = (("pkg.a", "pkg.b"), ("pkg",))
    root = tmp_path / "pkg"
    for name, source in {
        "__init__.py": "",
        "a/__init__.py": "",
        "a/x.py": "import pkg.b.y\n",
        "a/z.py": "",
        "b/__init__.py": "",
        "b/y.py": "",
        "b/w.py": "import pkg.a.z\n",
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(source)
    assert check(import_graph({"pkg": root}), layers, library=(), forbidden=()) == [
        "package cycle: pkg.a -> pkg.b -> pkg.a"
    ]


@pytest.mark.parametrize("name", ["pkg/new_module.py", "pkg/newpkg/__init__.py"])
def test_a_module_outside_every_floor_is_found(tmp_path: Path, name: str) -> None:
    problems = _plant(tmp_path, {name.removeprefix("pkg/"): ""})
    module = name.removeprefix("pkg/").removesuffix(".py").removesuffix("/__init__").replace("/", ".")
    assert problems == [f"pkg.{module}: no entry of LAYERS covers this module"]


# Tool-call formats: one package, a module per family, each owning its markup, detection and grammar.
TOOL_FAMILIES = ("qwen25", "llama3", "mistral")


def test_tool_call_formats_are_one_package_that_the_gateway_and_the_tokenizer_share() -> None:
    graph = import_graph(kubesgl_roots())
    for family in TOOL_FAMILIES:
        module = getattr(tool_formats, family)
        assert module.FORMAT.detect is module.detect and module.FORMAT.grammar is module.grammar, family
        assert tool_formats.FORMATS[module.FORMAT.name] is module.FORMAT
    assert set(tool_formats.FORMATS) == {getattr(tool_formats, f).FORMAT.name for f in TOOL_FAMILIES}

    def importers(prefix: str) -> set[str]:
        return {
            m
            for m in graph.files
            if m.startswith(prefix)
            for imp in graph.imports[m]
            if imp.target == "kubesgl.tool_formats" or imp.target.startswith("kubesgl.tool_formats.")
        }

    assert importers("kubesgl.services.gateway.") and importers("kubesgl.services.tokenizer.")
    outward = [
        f"{m} imports {imp.target}"
        for m in graph.files
        if m.startswith("kubesgl.tool_formats")
        for imp in graph.imports[m]
        if imp.target.startswith(("kubesgl.openai_api", "kubesgl.services", "kubesgl.runtime"))
    ]
    assert outward == []
