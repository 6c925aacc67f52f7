"""The embedded nats-server's GOMAXPROCS: what `kubesgl up` asks for (launcher.NATS_GOMAXPROCS) reaches the
server's environment, a GOMAXPROCS the user exported wins, and None leaves Go's default (no variable set)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubesgl.launcher import NATS_GOMAXPROCS, Stack, StackConfig
from kubesgl.runtime.nats_server import NatsServer


def _server_env(tmp_path: Path, gomaxprocs: int | None) -> dict[str, str]:
    server = NatsServer(tmp_path, gomaxprocs=gomaxprocs)
    server.start()
    try:
        assert server.proc is not None
        raw = Path(f"/proc/{server.proc.pid}/environ").read_bytes()
    finally:
        server.stop()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


def test_the_stack_asks_for_its_constant(tmp_path: Path) -> None:
    assert StackConfig("m", "m").nats_gomaxprocs == NATS_GOMAXPROCS == 2
    # ... and hands it to its server; 0 leaves Go's default.
    assert Stack(StackConfig("m", "m"), tmp_path / "a").nats.gomaxprocs == 2
    assert Stack(StackConfig("m", "m", nats_gomaxprocs=0), tmp_path / "b").nats.gomaxprocs is None


def test_gomaxprocs_reaches_the_server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    assert _server_env(tmp_path / "a", 2).get("GOMAXPROCS") == "2"
    assert "GOMAXPROCS" not in _server_env(tmp_path / "b", None)


def test_an_exported_gomaxprocs_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOMAXPROCS", "5")
    assert _server_env(tmp_path, 2).get("GOMAXPROCS") == "5"
