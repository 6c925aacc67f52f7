"""Prints the package's runtime requirements from pyproject.toml, minus the ones an image leaves out, or one
optional extra's (`--extra-only disagg`: NIXL, which the CPU scheduler image adds for the chart's prefill and
decode roles).

The CPU image (gateway, tokenizer, detokenizer) installs everything but torch: those services never
import it, and the CUDA build of torch alone is gigabytes. Reading pyproject keeps the image in step
with the package without a second, hand-kept list.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path


def requirement_name(requirement: str) -> str:
    """Normalised distribution name of a PEP 508 requirement string."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise ValueError(f"not a requirement: {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def requirements(pyproject: Path, without: set[str], extra: str | None = None) -> list[str]:
    """The [project] dependencies, or those of the optional extra `extra`, whose names are not in `without`."""
    project = tomllib.loads(pyproject.read_text())["project"]
    if extra is None:
        group = project["dependencies"]
    else:
        extras = project.get("optional-dependencies", {})
        if extra not in extras:
            raise SystemExit(f"pyproject.toml has no extra {extra!r} (it has: {', '.join(sorted(extras))})")
        group = extras[extra]
    dropped = {requirement_name(name) for name in without}
    return [req for req in group if requirement_name(req) not in dropped]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pyproject", type=Path, default=Path("pyproject.toml"))
    parser.add_argument("--without", action="append", default=[], help="distribution to leave out")
    parser.add_argument("--extra-only", default=None, help="print only this optional extra's requirements")
    args = parser.parse_args(argv)
    reqs = requirements(args.pyproject, set(args.without), args.extra_only)
    sys.stdout.write("".join(f"{req}\n" for req in reqs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
