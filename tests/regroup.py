"""Moves every test file into the group tests/layout.toml gives it, and the shared helpers into tests/support/.

    python tests/regroup.py               # the moves (`git mv`), staged; a second run changes nothing
    python tests/regroup.py --check       # only the problems: unlisted, missing or misplaced files
    python tests/regroup.py --paths unit  # where the files of the groups under unit/ are now (tests/run.sh)

A move keeps each file working from its new place: `Path(__file__)` walks get the extra levels, imports of a
helper become `from support.<helper> import ...` (in every tracked .py file, benchmark/ included), and every
`tests/<old path>` written in the tracked text files (docs, comments, scripts) names the new path. Nothing
moves while any problem is left: a test file or helper the layout does not list is reported, and the run fails.
"""

from __future__ import annotations

import argparse
import io
import re
import subprocess
import sys
import tokenize
import tomllib
from dataclasses import dataclass
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
LAYOUT = TESTS / "layout.toml"
SUPPORT = "support"
# Python files at tests/ root that stay there: pytest's conftest and this script.
ROOT_MODULES = ("conftest.py", "regroup.py")

_FILE_WALK = re.compile(r"Path\(__file__\)(\.resolve\(\))?((?:\.parent\b)+|\.parents\[(\d+)\])")


@dataclass(frozen=True)
class Layout:
    """tests/layout.toml: each group's test files, the helper modules, and whether the moves are done."""

    root: Path  # the tests/ directory the layout describes
    groups: dict[str, tuple[str, ...]]
    support: tuple[str, ...]
    regrouped: bool

    def group_of(self) -> dict[str, str]:
        return {name: group for group, names in self.groups.items() for name in names}

    def home(self, name: str) -> Path:
        """Where a test file belongs once regrouped."""
        return self.root / self.group_of()[name] / name

    def locate(self, name: str) -> Path | None:
        """Where a listed test file is now: its group, or tests/ root while the move is pending."""
        return next((p for p in (self.home(name), self.root / name) if p.is_file()), None)


def load_layout(path: Path = LAYOUT) -> Layout:
    data = tomllib.loads(path.read_text())
    groups = {group: tuple(names) for group, names in data["groups"].items()}
    return Layout(path.parent, groups, tuple(data["support"]), bool(data["regrouped"]))


def find_test_files(root: Path) -> list[Path]:
    """Every test module under `root` (data/ holds fixtures, not tests)."""
    return sorted(p for p in root.rglob("test_*.py") if "data" not in p.relative_to(root).parts[:-1])


def find_helper_files(root: Path) -> list[Path]:
    """The non-test Python modules at `root` and in its support/."""
    found = [p for p in root.glob("*.py") if p.name not in ROOT_MODULES and not p.name.startswith("test_")]
    found += [p for p in (root / SUPPORT).glob("*.py") if p.name != "__init__.py"]
    return sorted(found)


def problems(layout: Layout) -> list[str]:
    """What keeps the tree from matching the layout (empty: every file listed once and found)."""
    root = layout.root
    out: list[str] = []
    seen: dict[str, str] = {}
    for group, names in layout.groups.items():
        for name in names:
            if name in seen:
                out.append(f"{name} is listed in two groups: {seen[name]} and {group}")
            seen[name] = group
    group_of = layout.group_of()
    on_disk: dict[str, Path] = {}
    for path in find_test_files(root):
        rel = path.relative_to(root)
        if path.name in on_disk:
            out.append(
                f"two test files named {path.name}: tests/{on_disk[path.name].relative_to(root)} and tests/{rel}"
            )
        on_disk[path.name] = path
        if path.name not in group_of:
            out.append(f"tests/{rel} is not in tests/layout.toml: add it to the group of the part it pins")
        elif path not in (layout.home(path.name), root / path.name):
            out.append(f"tests/{rel} belongs in tests/{group_of[path.name]}/")
        elif layout.regrouped and path != layout.home(path.name):
            out.append(f"tests/{rel} belongs in tests/{group_of[path.name]}/ (the layout is regrouped)")
    for name in group_of:
        if name not in on_disk:
            out.append(f"tests/layout.toml lists {name}, which is nowhere under tests/")
    for path in find_helper_files(root):
        if path.stem not in layout.support:
            out.append(f"tests/{path.relative_to(root)} is not in tests/layout.toml's support list")
    for stem in layout.support:
        if not (root / f"{stem}.py").is_file() and not (root / SUPPORT / f"{stem}.py").is_file():
            out.append(
                f"tests/layout.toml lists the helper {stem}, which is neither in tests/ nor tests/{SUPPORT}/"
            )
    return out


def _walk_levels(match: re.Match[str]) -> int:
    return len(match.group(2).split(".parent")) - 1 if match.group(3) is None else int(match.group(3)) + 1


def _string_spans(text: str) -> list[tuple[int, int]]:
    """Offsets of the string literals in Python source (rewrites leave text inside them alone)."""
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    return [
        (starts[tok.start[0] - 1] + tok.start[1], starts[tok.end[0] - 1] + tok.end[1])
        for tok in tokenize.generate_tokens(io.StringIO(text).readline)
        if tok.type == tokenize.STRING or tok.type == getattr(tokenize, "FSTRING_MIDDLE", -1)
    ]


def deepen_file_walks(text: str, extra: int) -> str:
    """`Path(__file__)...parent` walks of a file moved `extra` directories deeper, still reaching their target."""
    strings = _string_spans(text)

    def walk(match: re.Match[str]) -> str:
        if any(lo <= match.start() < hi for lo, hi in strings):
            return match.group(0)
        levels = _walk_levels(match) + extra
        tail = ".parent" if levels == 1 else f".parents[{levels - 1}]"
        return f"Path(__file__){match.group(1) or ''}{tail}"

    return _FILE_WALK.sub(walk, text)


def unknown_file_uses(text: str) -> list[str]:
    """Lines using `__file__` (in code, not in strings) other than in walks deepen_file_walks adjusts or
    `Path(__file__).name`: a move would silently break them."""
    uses: dict[int, int] = {}
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.NAME and tok.string == "__file__":
            uses[tok.start[0]] = uses.get(tok.start[0], 0) + 1
    lines = text.splitlines()
    out = []
    for number, count in uses.items():
        line = lines[number - 1]
        if count > len(_FILE_WALK.findall(line)) + line.count("Path(__file__).name"):
            out.append(line.strip())
    return out


def import_rewrites(helpers: tuple[str, ...]) -> list[tuple[re.Pattern[str], str]]:
    """Helper imports (bare, or through the `tests` namespace) -> `support.<helper>`; `tests.conftest` ->
    `conftest` (one module, not a second copy of it under another name)."""
    names = "|".join(map(re.escape, helpers))
    return [
        (re.compile(rf"^(\s*)from (?:tests\.)?({names}) import\b", re.M), rf"\1from {SUPPORT}.\2 import"),
        (re.compile(rf"^(\s*)import ({names})\s*$", re.M), rf"\1from {SUPPORT} import \2"),
        (re.compile(r"^(\s*)from tests\.conftest import\b", re.M), r"\1from conftest import"),
    ]


def tracked_files() -> list[Path]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True).stdout
    return [REPO / p for p in out.decode().split("\0") if p]


def _git(*args: str) -> None:
    subprocess.run(["git", *args], cwd=REPO, check=True)


def planned_moves(layout: Layout) -> dict[Path, Path]:
    """Old path -> new path of every file still to move (empty once regrouped)."""
    moves = {TESTS / name: layout.home(name) for name in layout.group_of() if (TESTS / name).is_file()}
    for stem in layout.support:
        if (TESTS / f"{stem}.py").is_file():
            moves[TESTS / f"{stem}.py"] = TESTS / SUPPORT / f"{stem}.py"
    return moves


def regroup(layout: Layout) -> list[str]:
    """Performs the moves and the rewrites they need; returns what it did, one line each."""
    moves = planned_moves(layout)
    blocked = [
        f"{old.relative_to(REPO)}: {line}" for old in moves for line in unknown_file_uses(old.read_text())
    ]
    if blocked:
        raise SystemExit(
            "uses of __file__ a move would break (rewrite them as Path(__file__).resolve().parent...):\n  "
            + "\n  ".join(blocked)
        )
    done: list[str] = []
    init = TESTS / SUPPORT / "__init__.py"
    if not init.exists():
        init.parent.mkdir(exist_ok=True)
        init.write_text('"""Helpers shared by the tests (tests/layout.toml lists them)."""\n')
        _git("add", str(init))
        done.append(f"created {init.relative_to(REPO)}")
    changed: list[Path] = []
    for old, new in moves.items():
        new.parent.mkdir(parents=True, exist_ok=True)
        _git("mv", str(old), str(new))
        extra = len(new.relative_to(TESTS).parts) - 1
        new.write_text(deepen_file_walks(new.read_text(), extra))
        changed.append(new)
        done.append(f"moved {old.relative_to(REPO)} -> {new.relative_to(REPO)}")

    renames = {str(o.relative_to(REPO)): str(n.relative_to(REPO)) for o, n in moves.items()}
    path_ref = re.compile(r"(?<![\w/.])(" + "|".join(map(re.escape, renames)) + r")\b") if renames else None
    imports = import_rewrites(layout.support)
    for path in tracked_files():
        if not path.is_file():
            continue
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new_text = path_ref.sub(lambda m: renames[m.group(1)], text) if path_ref else text
        if path.suffix == ".py":
            for pattern, repl in imports:
                new_text = pattern.sub(repl, new_text)
        if new_text != text:
            path.write_text(new_text)
            changed.append(path)
            done.append(f"rewrote {path.relative_to(REPO)}")
    if not layout.regrouped:
        LAYOUT.write_text(re.sub(r"(?m)^regrouped = false$", "regrouped = true", LAYOUT.read_text(), count=1))
        changed.append(LAYOUT)
        done.append("set regrouped = true in tests/layout.toml")
    python = sorted({str(p) for p in changed if p.suffix == ".py"})
    if python:  # `support.*` imports sort elsewhere than the bare names did
        subprocess.run(
            [sys.executable, "-m", "ruff", "check", "-q", "--fix", "--select", "I", *python], cwd=REPO
        )
        subprocess.run([sys.executable, "-m", "ruff", "format", "-q", *python], cwd=REPO, check=True)
    if changed:
        _git("add", *sorted({str(p) for p in changed}))
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--check", action="store_true", help="report problems, change nothing")
    parser.add_argument(
        "--paths", metavar="PREFIX", help="print the current paths of the groups under PREFIX"
    )
    args = parser.parse_args(argv)
    layout = load_layout()
    if args.paths is not None:
        prefix = args.paths.rstrip("/")
        for group, names in layout.groups.items():
            if group == prefix or group.startswith(prefix + "/"):
                for name in names:
                    if (path := layout.locate(name)) is not None:
                        print(path.relative_to(REPO))
        return 0
    found = problems(layout)
    if found:
        print("tests/layout.toml does not match the tree:\n  " + "\n  ".join(found), file=sys.stderr)
        return 1
    if args.check:
        return 0
    for line in regroup(layout):
        print(line)
    left = problems(load_layout())
    if left:
        print("after the moves:\n  " + "\n  ".join(left), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
