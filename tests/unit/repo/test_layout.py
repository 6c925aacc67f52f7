"""tests/layout.toml stays complete and true: every test file is listed in exactly one group and sits where the
layout says (tests/ root while the regroup is pending, its group once regrouped), every helper module is listed,
each test carries its group's marker, and tests/regroup.py's rewrites keep a moved file's paths and imports."""

from __future__ import annotations

from pathlib import Path

import pytest
from regroup import (
    deepen_file_walks,
    import_rewrites,
    load_layout,
    problems,
    unknown_file_uses,
)

LAYOUT = """
regrouped = {regrouped}
support = ["shared_helpers"]
[groups]
"unit/engine" = ["test_a.py"]
"e2e" = ["test_b.py"]
"""


def _tree(root: Path, regrouped: bool, files: list[str]) -> Path:
    (root / "layout.toml").write_text(LAYOUT.format(regrouped=str(regrouped).lower()))
    for rel in files:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("")
    return root / "layout.toml"


def test_every_test_file_is_listed_once_and_in_its_place() -> None:
    assert problems(load_layout()) == []


def test_this_file_carries_its_groups_marker(request: pytest.FixtureRequest) -> None:
    group = load_layout().group_of()[request.path.name]
    assert request.node.get_closest_marker(group.split("/")[0]) is not None


def test_pending_layout_accepts_root_and_group_places(tmp_path: Path) -> None:
    layout = _tree(tmp_path, False, ["test_a.py", "e2e/test_b.py", "shared_helpers.py"])
    assert problems(load_layout(layout)) == []


def test_unlisted_and_misplaced_files_are_reported(tmp_path: Path) -> None:
    files = ["unit/kv/test_a.py", "e2e/test_b.py", "test_new.py", "stray_helpers.py"]
    found = problems(load_layout(_tree(tmp_path, False, files)))
    assert sorted(found) == [
        "tests/layout.toml lists the helper shared_helpers, which is neither in tests/ nor tests/support/",
        "tests/stray_helpers.py is not in tests/layout.toml's support list",
        "tests/test_new.py is not in tests/layout.toml: add it to the group of the part it pins",
        "tests/unit/kv/test_a.py belongs in tests/unit/engine/",
    ]


def test_regrouped_layout_refuses_test_files_at_the_root(tmp_path: Path) -> None:
    layout = _tree(tmp_path, True, ["test_a.py", "e2e/test_b.py", "support/shared_helpers.py"])
    assert problems(load_layout(layout)) == [
        "tests/test_a.py belongs in tests/unit/engine/ (the layout is regrouped)"
    ]


def test_missing_and_twice_listed_files_are_reported(tmp_path: Path) -> None:
    layout = _tree(tmp_path, False, ["shared_helpers.py", "e2e/test_b.py"])
    layout.write_text(
        layout.read_text().replace('"e2e" = ["test_b.py"]', '"e2e" = ["test_b.py", "test_a.py"]')
    )
    assert sorted(problems(load_layout(layout))) == [
        "test_a.py is listed in two groups: unit/engine and e2e",
        "tests/layout.toml lists test_a.py, which is nowhere under tests/",
    ]


@pytest.mark.parametrize(
    ("walk", "extra", "moved"),
    [
        ("Path(__file__).resolve().parents[1]", 2, "Path(__file__).resolve().parents[3]"),
        ("Path(__file__).resolve().parent.parent", 1, "Path(__file__).resolve().parents[2]"),
        ('Path(__file__).resolve().parent / "data"', 1, 'Path(__file__).resolve().parents[1] / "data"'),
        ("Path(__file__).parent", 0, "Path(__file__).parent"),
    ],
)
def test_moved_file_walks_still_reach_their_directory(
    walk: str, extra: int, moved: str, tmp_path: Path
) -> None:
    assert deepen_file_walks(walk, extra) == moved
    old = tmp_path / "tests" / "test_x.py"
    new = tmp_path / "tests" / Path(*["g"] * extra) / "test_x.py"
    assert eval(walk, {"Path": Path, "__file__": str(old)}) == eval(
        moved, {"Path": Path, "__file__": str(new)}
    )


def test_walks_inside_strings_stay_as_written() -> None:
    text = 'DOC = "Path(__file__).parent"\nHERE = Path(__file__).parent\n'
    assert deepen_file_walks(text, 1) == 'DOC = "Path(__file__).parent"\nHERE = Path(__file__).parents[1]\n'


def test_file_uses_a_move_cannot_adjust_are_reported() -> None:
    text = "HERE = os.path.dirname(__file__)\nROOT = Path(__file__).resolve().parents[1]\nNAME = Path(__file__).name\n"
    assert unknown_file_uses(text) == ["HERE = os.path.dirname(__file__)"]


def test_helper_imports_point_into_support() -> None:
    text = (
        "from bus_client import BusClient\n    from model_helpers import X\nimport local_stack\n"
        "from bus_clientx import Y\nfrom tests.model_helpers import Z\nfrom tests.conftest import StackFactory\n"
    )
    for pattern, repl in import_rewrites(("bus_client", "model_helpers", "local_stack")):
        text = pattern.sub(repl, text)
    assert text == (
        "from support.bus_client import BusClient\n    from support.model_helpers import X\n"
        "from support import local_stack\nfrom bus_clientx import Y\n"
        "from support.model_helpers import Z\nfrom conftest import StackFactory\n"
    )
