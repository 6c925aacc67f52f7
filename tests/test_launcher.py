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


def _up(demo_model_dir: str, port: int, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "KUBESGL_CACHE": str(Path(demo_model_dir).parent), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "kubesgl.cli", "up", "--model", "demo", "--port", str(port)]
    cmd += ["--device", "cpu", "--scheduler-args", "--num-pages 4096", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def test_up_serves_the_demo_model_and_ctrl_c_leaves_no_process(demo_model_dir: str) -> None:
    port = free_port()
    proc = _up(demo_model_dir, port)
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


def test_up_caps_a_demo_request_without_max_tokens(demo_model_dir: str) -> None:
    """OpenAI's quickstart sends no max_tokens; the demo model never picks EOS, so `kubesgl up` serves it with a
    server-side default (printed at start-up) instead of running to the end of its 40k-token context."""
    port = free_port()
    proc = _up(demo_model_dir, port)
    try:
        lines = _lines(proc)
        cap = _wait_for(lines, "a request without max_tokens gets at most", 240)
        assert "256 tokens" in cap
        _wait_for(lines, "serving `demo` at", 240)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["usage"]["completion_tokens"] == 256 and body["choices"][0]["finish_reason"] == "length"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_takes_the_stack_down_when_a_service_dies(demo_model_dir: str) -> None:
    proc = _up(demo_model_dir, free_port(), "--gateways", "0")
    try:
        _wait_for(_lines(proc), "serving `demo`", 240)
        children = psutil.Process(proc.pid).children(recursive=True)
        scheduler = next(c for c in children if "scheduler" in c.cmdline())
        scheduler.kill()
        assert proc.wait(90) == 1
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"orphans: {[p.cmdline() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_refuses_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kubesgl.cli", "up", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "is not a model directory (no config.json)" in out.stderr
