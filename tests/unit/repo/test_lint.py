"""The tree stays ruff-clean (lint and format), as STYLE.md asks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _ruff(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_ruff_check_is_clean() -> None:
    r = _ruff("check", ".")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format_is_clean() -> None:
    r = _ruff("format", "--check", ".")
    assert r.returncode == 0, r.stdout + r.stderr
