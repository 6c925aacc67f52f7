"""`kubesgl bench serve --burst-hook`: the command runs to its end with BURST_PHASE set, its exit status comes
back (a failed phase is named in the run's figures), and no command is no run."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kubesgl.bench.serve import burst_hook


def test_the_hook_sees_its_phase_and_reports_its_status(tmp_path: Path, capsys) -> None:
    log = tmp_path / "phases"
    assert asyncio.run(burst_hook(f'echo "$BURST_PHASE" >> {log}', "start")) == 0
    assert asyncio.run(burst_hook(f'echo "$BURST_PHASE" >> {log}; exit 3', "end")) == 3
    assert log.read_text().split() == ["start", "end"]
    assert "--burst-hook (end) exited 3" in capsys.readouterr().err
    assert asyncio.run(burst_hook(None, "start")) == 0
