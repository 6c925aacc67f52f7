"""`kubesgl up` as a user runs it: builds/loads the demo model, starts nats-server and every service as its
own process, serves OpenAI requests, and on Ctrl-C stops everything with no orphan process left."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import httpx
import psutil
import pytest
from kubesgl.launcher import free_port

pytestmark = pytest.mark.timeout(300)


def _lines(proc: subprocess.Popen[str]) -> queue.Queue[str]:
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return lines


def _wait_for(lines: queue.Queue[str], needle: str, timeout_s: float) -> str:
    seen = []
    while True:
        try:
            line = lines.get(timeout=timeout_s)
        except queue.Empty:
            raise AssertionError(
                f"no {needle!r} within {timeout_s} s; output:\n{''.join(seen[-40:])}"
            ) from None
        seen.append(line)
        if needle in line:
            return line


def test_up_serves_the_demo_model_and_ctrl_c_leaves_no_process(demo_model_dir: str) -> None:
    port = free_port()
    env = {**os.environ, "KUBESGL_CACHE": str(Path(demo_model_dir).parent), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kubesgl.cli", "up", "--model", "demo", "--port", str(port)]
    cmd += ["--device", "cpu", "--scheduler-args", "--num-pages 4096"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = _lines(proc)
        banner = _wait_for(lines, "serving `demo` at", 240)
        assert f"http://127.0.0.1:{port}/v1" in banner
        base = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{base}/ready", timeout=10).status_code == 200
        reply = httpx.post(
            f"{base}/v1/completions",
            json={"model": "demo", "prompt": "Hello", "max_tokens": 4, "temperature": 0},
            timeout=60,
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 4
        children = psutil.Process(proc.pid).children(recursive=True)
        assert len(children) >= 5  # nats-server, gateway, tokenizer, scheduler, detokenizer
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"orphans: {[p.cmdline() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
