"""Rewrites a nixl-cu13 wheel without what the UCX backend never loads, so it fits a device call's 64 MiB carry
beside the serve path's wheels: the expert-parallel extension (nixl_ep_cu13, ~90 MiB unpacked), the other
backends' plugins (GDS, POSIX, OBJ, Azure, ...) and every bundled library outside the dynamic-link closure of
the Python bindings, the UCX plugin and UCX's own transport modules (libnuma kept: UCX may dlopen it).
56 MiB -> ~15 MiB. Needs binutils' readelf.

    python benchmark/slim_nixl_wheel.py .pd/nixl_cu13-1.5.1-*.whl
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath


def _needed(path: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\).*\[(.+)\]", out)


def slim(wheel: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        with zipfile.ZipFile(wheel) as z:
            names = z.namelist()
            z.extractall(root)
        libs = [n for n in names if re.search(r"\.so(\.|$)", n)]
        by_base: dict[str, list[str]] = {}
        for n in libs:
            by_base.setdefault(PurePosixPath(n).name, []).append(n)
        roots = [
            n
            for n in libs
            if not n.startswith("nixl_ep")
            and (n.startswith("nixl_cu13/") or "/ucx/" in n or n.endswith("libplugin_UCX.so"))
        ]
        keep: set[str] = set()
        todo = list(roots)
        while todo:
            n = todo.pop()
            if n not in keep:
                keep.add(n)
                todo += [m for dep in _needed(root / n) for m in by_base.get(dep, [])]
        drop = {n for n in names if n.startswith("nixl_ep")}
        drop |= {n for n in libs if "perftest" in n or (n not in keep and "libnuma" not in n)}
        record = next(n for n in names if n.endswith(".dist-info/RECORD"))
        lines = (root / record).read_text().splitlines()
        (root / record).write_text("".join(ln + "\n" for ln in lines if ln.split(",")[0] not in drop))
        with zipfile.ZipFile(wheel, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
            for n in names:
                if n not in drop and not n.endswith("/"):
                    z.write(root / n, n)
    print(f"{wheel}: {len(drop)} files dropped, {wheel.stat().st_size / 2**20:.1f} MiB")


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        slim(Path(arg))
