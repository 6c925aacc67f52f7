"""Helpers for gateway tests: a gateway as its own OS process, and waiting on HTTP endpoints."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
from kubesgl.runtime.listen import listen_socket


class GatewayProcess:
    def __init__(self, nats_url: str, log_dir: Path, *args: str) -> None:
        # Bound here and handed over, as the launcher does: a parallel test cannot take the port meanwhile.
        # With --workers the other workers' sockets join this one's port (SO_REUSEPORT).
        with listen_socket("127.0.0.1", 0, reuse_port="--workers" in args) as sock:
            self.port = sock.getsockname()[1]
            self.url = f"http://127.0.0.1:{self.port}"
            self.log_path = log_dir / f"gateway-{self.port}.log"
            cmd = [
                sys.executable,
                "-m",
                "kubesgl.cli",
                "gateway",
                "--nats-url",
                nats_url,
                "--host",
                "127.0.0.1",
            ]
            cmd += ["--port", str(self.port), "--fd", str(sock.fileno()), *args]
            self._log = open(self.log_path, "wb")  # noqa: SIM115 - lives as long as the process
            self.proc = subprocess.Popen(
                cmd,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=dict(os.environ),
                pass_fds=(sock.fileno(),),
            )

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        wait_http(f"{self.url}/health", timeout_s, self)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout_s: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        return self.proc.returncode


def wait_http(url: str, timeout_s: float, proc: GatewayProcess | None = None) -> None:
    """Until GET `url` answers 200; fails early if the process died."""
    end = time.monotonic() + timeout_s
    last = ""
    while time.monotonic() < end:
        if proc is not None and proc.proc.poll() is not None:
            raise RuntimeError(f"gateway exited with {proc.proc.returncode}:\n{proc.log()}")
        try:
            r = httpx.get(url, timeout=2.0)
            if r.status_code == 200:
                return
            last = f"{r.status_code} {r.text}"
        except httpx.HTTPError as e:
            last = repr(e)
        time.sleep(0.1)
    raise TimeoutError(f"{url} not 200 after {timeout_s}s (last: {last})")
