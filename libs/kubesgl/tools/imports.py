"""The layers of kubesgl and a check of the real import graph against them: `python -m kubesgl.tools.imports`.

`LAYERS` is the one place the order is declared, bottom floor first. A module may import modules of its own
floor or of floors below it, never above. The walk reads every module's source (ast, so imports inside
functions and `if TYPE_CHECKING:` blocks count too) and reports:

- an import cycle between modules, or between the entries of `LAYERS` (a package-level circle hides
  behind lazy imports as easily as a module-level one);
- an arrow against the floor order;
- a module that no entry of `LAYERS` covers (a new package must be given its floor);
- a `LIBRARY` module (the engine and what it stands on) importing the wire or the service side:
  NATS, HTTP, Prometheus, OpenTelemetry, msgpack, msgspec, pydantic, `kubesgl.codec`, `kubesgl.protocol` or
  `kubesgl.runtime`.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Bottom first. An entry names a package and everything in it, or one module; a top-level package's name
# alone ("kubesgl") covers only its __init__, so a new module or package must be placed explicitly.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "kubesgl.errors",
        "kubesgl.values",
        "kubesgl.env",
    ),  # the engine's public values: SamplingParams, RequestOutput, ...
    ("kubesgl.codec", "kubesgl.protocol"),  # the wire: every subject and message, carrying those values
    ("kubesgl.distributed", "kubesgl.kv", "kubesgl.text", "kubesgl.structured"),
    ("kubesgl.attention", "kubesgl.kernels"),
    ("kubesgl.layers",),
    ("kubesgl.models",),
    ("kubesgl.engine",),
    (
        "kubesgl.routing",
        "kubesgl.cache_routing",
        "kubesgl.openai_api",
        "kubesgl.tool_formats",
    ),  # pure logic over the wire's values
    ("kubesgl.runtime",),  # the service runtime: NATS, admin HTTP, metrics, tracing, local processes
    (  # processes: the services, the launcher and the command line
        "kubesgl.services",
        "kubesgl.launcher",
        "kubesgl.shell",
        "kubesgl.bench",
        "kubesgl.cli",
        "kubesgl.tools",
        "kubesgl",
    ),
)

# The engine and everything it stands on: it knows nothing of the wire, NATS, HTTP or metrics.
LIBRARY = (
    "kubesgl.env",
    "kubesgl.errors",
    "kubesgl.values",
    "kubesgl.distributed",
    "kubesgl.kv",
    "kubesgl.text",
    "kubesgl.structured",
    "kubesgl.attention",
    "kubesgl.kernels",
    "kubesgl.layers",
    "kubesgl.models",
    "kubesgl.engine",
)
LIBRARY_FORBIDDEN = (
    "nats",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "prometheus_client",
    "opentelemetry",
    "msgpack",
    "msgspec",
    "pydantic",
    "kubesgl.codec",
    "kubesgl.protocol",
    "kubesgl.runtime",
)


@dataclass(frozen=True)
class Import:
    target: str  # a module of the graph, or an external top-level package
    line: int


@dataclass
class ImportGraph:
    """Every module (by dotted name) and what it imports, its own package's modules resolved."""

    files: dict[str, Path]
    imports: dict[str, list[Import]]


def import_graph(roots: Mapping[str, Path]) -> ImportGraph:
    """Parses every .py file under each root (package name -> directory); symlinked directories are skipped,
    so a package linked into another is read once, from its own root."""
    files: dict[str, Path] = {}
    for package, root in roots.items():
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")
            rel = Path(dirpath).relative_to(root).parts
            for name in sorted(filenames):
                if name.endswith(".py"):
                    parts = [package, *rel] + ([] if name == "__init__.py" else [name[:-3]])
                    files[".".join(parts)] = Path(dirpath) / name
    graph = ImportGraph(files, {})
    for module, path in files.items():
        is_package = path.name == "__init__.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        graph.imports[module] = [
            Import(target, node.lineno)
            for node in ast.walk(tree)
            for target in _targets(node, module, is_package, files)
        ]
    return graph


def _targets(node: ast.AST, module: str, is_package: bool, known: Mapping[str, Path]) -> Iterable[str]:
    if isinstance(node, ast.Import):
        return [_resolve(a.name, known) for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = module.split(".")
        anchor = anchor if is_package else anchor[:-1]
        anchor = anchor[: len(anchor) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    # `from pkg import name` imports the submodule pkg.name when there is one, else pkg itself.
    return [_resolve(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base, known) for a in node.names]


def _resolve(name: str, known: Mapping[str, Path]) -> str:
    """The module of the graph `name` is (or is in), else its external top-level package."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in known:
            return candidate
    return parts[0]


def _floor_of(module: str, layers: Sequence[Sequence[str]]) -> tuple[int, str] | None:
    """(floor index, the entry covering `module`): the longest entry that is the module or a package of it."""
    best: tuple[int, str] | None = None
    for i, floor in enumerate(layers):
        for entry in floor:
            covers = module == entry or ("." in entry and module.startswith(entry + "."))
            if covers and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    return best


def check(
    graph: ImportGraph,
    layers: Sequence[Sequence[str]] = LAYERS,
    library: Sequence[str] = LIBRARY,
    forbidden: Sequence[str] = LIBRARY_FORBIDDEN,
) -> list[str]:
    """Every problem found, one line each (empty when the graph keeps to the layers)."""
    problems: list[str] = []
    floors = {m: _floor_of(m, layers) for m in graph.files}
    problems += [f"{m}: no entry of LAYERS covers this module" for m, f in floors.items() if f is None]
    internal: dict[str, set[str]] = {m: set() for m in graph.files}
    for module, imports in graph.imports.items():
        where = floors[module]
        for imp in imports:
            target = imp.target
            at = f"{module} (line {imp.line})"
            if _matches(module, library) and _matches(target, forbidden):
                problems.append(f"{at}: the library imports {target}")
            if target not in graph.files or target == module:
                continue
            internal[module].add(target)
            there = floors[target]
            if where is not None and there is not None and there[0] > where[0]:
                problems.append(f"{at}: imports {target}, a floor above ({there[1]} over {where[1]})")
    problems += [f"import cycle: {' -> '.join(c)}" for c in _cycles(internal)]
    units: dict[str, set[str]] = {}
    for module, targets in internal.items():
        if (mine := floors[module]) is not None:
            units.setdefault(mine[1], set())
            units[mine[1]] |= {t[1] for x in targets if (t := floors[x]) is not None and t[1] != mine[1]}
    problems += [f"package cycle: {' -> '.join(c)}" for c in _cycles(units)]
    return problems


def _matches(target: str, names: Sequence[str]) -> bool:
    return any(target == n or target.startswith(n + ".") for n in names)


def _cycles(edges: Mapping[str, set[str]]) -> list[list[str]]:
    """One cycle (a path back to its start) per strongly connected component of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan; the graphs here are small enough for recursion
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [_path_through(sorted(c), edges) for c in components]


def _path_through(component: list[str], edges: Mapping[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first node back to itself (breadth first, inside it)."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, ())):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [*reversed(path), start]
                if w in members and w not in came_from:
                    came_from[w] = v
                    nxt.append(w)
        frontier = nxt
    return component


def kubesgl_roots() -> dict[str, Path]:
    """Where the kubesgl package and its services package live in this checkout."""
    roots = {}
    for name in ("kubesgl", "kubesgl.services"):
        spec = importlib.util.find_spec(name)
        assert spec is not None and spec.submodule_search_locations, f"{name} is not importable"
        roots[name] = Path(next(iter(spec.submodule_search_locations))).resolve()
    return roots


def main() -> int:
    problems = check(import_graph(kubesgl_roots()))
    for floor in reversed(LAYERS):
        print("  " + "  ".join(floor))
    print(
        f"{len(problems)} problem(s)" if problems else "the imports keep to the layers: no cycle, no arrow up"
    )
    for p in problems:
        print("  " + p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
