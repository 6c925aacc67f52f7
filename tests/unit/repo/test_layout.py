"""Where tests live: the folder is the group (tests/conftest.py marks each test from it). Every test file sits in
tests/unit/<part>/, the folder named after the part of kubesgl it pins, in tests/e2e/ or in tests/deploy/; helper
modules in tests/support/; no two test files share a name (pytest imports them by it)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import GROUPS, REPO, TESTS, group_of

# The unit folder that pins the tree itself (layers, lint, this layout) rather than one part.
WHOLE_TREE = "repo"


def kubesgl_parts(repo: Path) -> set[str]:
    """What a unit folder may be named after: a top-level module of kubesgl (libs/kubesgl/<name>.py), a package
    of kubesgl at any depth (libs/kubesgl/runtime/telemetry/, services/gateway/), or a folder of Python tools at
    the repository's top (loadtest/)."""
    lib, apps = repo / "libs" / "kubesgl", repo / "services"
    parts = {p.stem for p in lib.glob("*.py") if p.name != "__init__.py"}
    parts |= {
        p.parent.name
        for root in (lib, apps)
        for p in root.rglob("__init__.py")
        if p.parent not in (lib, apps)
    }
    parts |= {p.parent.name for p in repo.glob("*/*.py") if p.parent.name not in ("services", "tests")}
    return parts


def layout_problems(repo: Path) -> list[str]:
    """Each test file or helper module out of place, each unit folder that names no part; empty when none."""
    tests = repo / "tests"
    parts = kubesgl_parts(repo) | {WHOLE_TREE}
    out: list[str] = []
    seen: dict[str, Path] = {}
    for path in sorted(tests.rglob("*.py")):
        rel = path.relative_to(tests)
        if rel.parts[0] == "data" or path.name == "conftest.py":  # data/ holds fixtures
            continue
        where = f"tests/{rel}"
        if not path.name.startswith("test_"):
            if rel.parts[0] != "support" or len(rel.parts) != 2:
                out.append(f"{where} is a helper: helpers live in tests/support/")
            continue
        if path.name in seen:
            out.append(f"two test files named {path.name}: tests/{seen[path.name]} and {where}")
        seen[path.name] = rel
        depth = {"unit": 3, "e2e": 2, "deploy": 2}.get(rel.parts[0])
        if depth is None or len(rel.parts) != depth:
            out.append(f"{where} is in no group: put it in tests/unit/<part>/, tests/e2e/ or tests/deploy/")
        elif depth == 3 and rel.parts[1] not in parts:
            out.append(
                f"tests/unit/{rel.parts[1]}/ names no part of kubesgl (a module, package or tools folder)"
            )
    return sorted(set(out))


def test_every_test_file_lives_in_a_group_folder() -> None:
    assert layout_problems(REPO) == []


def test_this_file_carries_its_groups_marker(request: pytest.FixtureRequest) -> None:
    assert group_of(request.path) == "unit"
    assert request.node.get_closest_marker("unit") is not None
    assert {m.name for m in request.node.iter_markers()} & set(GROUPS) == {"unit"}


def test_the_group_is_the_top_folder() -> None:
    assert group_of(TESTS / "unit" / "kv" / "test_x.py") == "unit"
    assert group_of(TESTS / "e2e" / "test_x.py") == "e2e"
    assert group_of(TESTS / "deploy" / "test_x.py") == "deploy"
    assert group_of(TESTS / "support" / "test_x.py") is None
    assert group_of(REPO / "benchmark" / "test_x.py") is None


def _tree(root: Path, files: list[str]) -> Path:
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    return root


GOOD = [
    "libs/kubesgl/__init__.py",
    "libs/kubesgl/protocol.py",
    "libs/kubesgl/runtime/__init__.py",
    "libs/kubesgl/runtime/telemetry/__init__.py",
    "services/__init__.py",
    "services/gateway/__init__.py",
    "services/gateway/app.py",
    "loadtest/soak.py",
    "tests/conftest.py",
    "tests/support/__init__.py",
    "tests/support/helpers.py",
    "tests/data/fixture_gen.py",
    "tests/unit/protocol/test_a.py",
    "tests/unit/telemetry/test_b.py",
    "tests/unit/gateway/test_c.py",
    "tests/unit/loadtest/test_d.py",
    "tests/unit/repo/test_e.py",
    "tests/e2e/test_f.py",
    "tests/e2e/conftest.py",
    "tests/deploy/test_g.py",
]


def test_a_tree_in_its_groups_has_no_problems(tmp_path: Path) -> None:
    assert layout_problems(_tree(tmp_path, GOOD)) == []


def test_files_out_of_their_groups_are_reported(tmp_path: Path) -> None:
    stray = [
        "tests/test_root.py",
        "tests/unit/test_no_part.py",
        "tests/e2e/nested/test_deep.py",
        "tests/unit/app/test_h.py",  # services/gateway/app.py is a module below the top, not a part
        "tests/unit/kv/test_f.py",
        "tests/stray_helpers.py",
        "tests/support/nested/more_helpers.py",
    ]
    assert layout_problems(_tree(tmp_path, GOOD + stray)) == [
        "tests/e2e/nested/test_deep.py is in no group: put it in tests/unit/<part>/, tests/e2e/ or tests/deploy/",
        "tests/stray_helpers.py is a helper: helpers live in tests/support/",
        "tests/support/nested/more_helpers.py is a helper: helpers live in tests/support/",
        "tests/test_root.py is in no group: put it in tests/unit/<part>/, tests/e2e/ or tests/deploy/",
        "tests/unit/app/ names no part of kubesgl (a module, package or tools folder)",
        "tests/unit/kv/ names no part of kubesgl (a module, package or tools folder)",
        "tests/unit/test_no_part.py is in no group: put it in tests/unit/<part>/, tests/e2e/ or tests/deploy/",
        "two test files named test_f.py: tests/e2e/test_f.py and tests/unit/kv/test_f.py",
    ]


def test_scripts_name_test_files_that_exist() -> None:
    """tests/numerics.sh and the Makefile select test files by path: a move must take them along."""
    named = {
        m
        for script in ("tests/numerics.sh", "Makefile")
        for m in re.findall(r"tests/[\w/]+\.py", (REPO / script).read_text())
    }
    assert named and sorted(p for p in named if not (REPO / p).is_file()) == []
