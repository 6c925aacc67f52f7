"""`kubesgl up` as a user runs it: builds/loads the demo model, starts nats-server and every service as its
own process on fixed ports, prints every service's metrics URL, serves OpenAI requests, refuses plainly to
start a second time on the same ports, shows why a service died, restarts one that dies, and on Ctrl-C stops everything with no
orphan process left."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import psutil
import pydantic
import pytest
from kubesgl.launcher import (
    DEMO_DEFAULT_MAX_TOKENS,
    Stack,
    StackConfig,
    free_port,
    http_ok,
    planned_ports,
    port_free,
)

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
    # Free admin ports unless a test fixes them (8100 up, the default, may be taken on a shared machine).
    cmd += ["--device", "cpu", "--scheduler-args", "--num-pages 4096", "--base-port", "0", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)


def _free_range(n: int) -> int:
    """The first of `n` consecutive free ports (a random range, so parallel runs rarely collide)."""
    rng = random.Random()
    for _ in range(200):
        start = rng.randrange(20000, 60000)
        if all(port_free("127.0.0.1", p) for p in range(start, start + n)):
            return start
    raise AssertionError(f"no {n} consecutive free ports")


def test_up_serves_the_demo_model_and_ctrl_c_leaves_no_process(demo_model_dir: str) -> None:
    port, base_port = _free_range(1), _free_range(3)
    proc = _up(demo_model_dir, port, "--base-port", str(base_port))
    try:
        lines = _lines(proc)
        banner = _wait_for(lines, "serving `demo` at", 240)
        assert f"http://127.0.0.1:{port}/v1" in banner
        # Every service's metrics URL, on the ports the flags fix, in start order from --base-port.
        urls = {}
        for _ in range(4):
            name, url = _wait_for(lines, "/metrics", 10).split()
            urls[name] = url
        assert urls == {
            "gateway-0": f"http://127.0.0.1:{port}/metrics",
            "scheduler-0": f"http://127.0.0.1:{base_port}/metrics",
            "detokenizer-0": f"http://127.0.0.1:{base_port + 1}/metrics",
            "tokenizer-0": f"http://127.0.0.1:{base_port + 2}/metrics",
        }
        for url in urls.values():
            scrape = httpx.get(url, timeout=10)
            assert scrape.status_code == 200 and "kubesgl_" in scrape.text, url
        # A second `up` on the same ports says plainly why it cannot start, and which flag moves it.
        second = _up(demo_model_dir, port, "--base-port", str(base_port))
        out, _ = second.communicate(timeout=60)
        assert second.returncode == 2, out
        assert f"port {port} for gateway-0 is already in use: another kubesgl stack is serving there" in out
        assert "--port" in out and "--base-port" in out
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


class Person(pydantic.BaseModel):
    name: str
    age: int
    tags: list[str]


def _structured_outputs_finish_on_the_demo(base_url: str) -> None:
    """The SDK's parse() with an ordinary pydantic model, and an enforced tool call with open string and integer
    parameters, both finish on the demo (its grammars bound open values: --bound-json-values)."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=120)
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    for seed in (1, 2):
        done = parse(
            model="demo",
            messages=[{"role": "user", "content": "Describe a person."}],
            response_format=Person,
            seed=seed,
        )
        assert isinstance(done.choices[0].message.parsed, Person)
    tool = {
        "type": "function",
        "function": {
            "name": "lookup",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}, "limit": {"type": "integer"}},
                "required": ["query", "limit"],
            },
        },
    }
    called = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "Look it up."}],
        tools=[tool],
        tool_choice="required",
        seed=1,
    )
    choice = called.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    args = json.loads(choice.message.tool_calls[0].function.arguments)
    assert isinstance(args["query"], str) and isinstance(args["limit"], int)


def test_up_caps_a_demo_request_without_max_tokens(demo_model_dir: str) -> None:
    """OpenAI's quickstart sends no max_tokens; the demo model never picks EOS, so `kubesgl up` serves it with a
    server-side default (printed at start-up) instead of running to the end of its 40k-token context."""
    port = free_port()
    proc = _up(demo_model_dir, port)
    try:
        lines = _lines(proc)
        cap = _wait_for(lines, "a request without max_tokens gets at most", 240)
        assert f"{DEMO_DEFAULT_MAX_TOKENS} tokens" in cap
        _wait_for(lines, "serving `demo` at", 240)
        reply = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            json={"model": "demo", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0},
            timeout=120,
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert (
            body["usage"]["completion_tokens"] == DEMO_DEFAULT_MAX_TOKENS
            and body["choices"][0]["finish_reason"] == "length"
        )
        _structured_outputs_finish_on_the_demo(f"http://127.0.0.1:{port}/v1")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _kill_if_running(proc: subprocess.Popen[Any], children: list[psutil.Process]) -> None:
    """A failed test's clean-up: `make` (or `kubesgl up`) and every process it had started."""
    if proc.poll() is None:
        for c in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                c.kill()
        proc.kill()
        proc.wait()


def test_sigint_to_make_up_stops_the_stack(demo_model_dir: str) -> None:
    """`kill -INT <make>`: GNU make hands a SIGINT on to nobody and waits for its recipe, which used to serve
    on (45 s and more); `kubesgl up` notices make's signal and stops as on Ctrl-C, and make exits with it."""
    repo = Path(__file__).resolve().parents[2]
    args = f"--port {free_port()} --base-port 0 --device cpu --scheduler-args '--num-pages 4096'"
    env = {**os.environ, "KUBESGL_CACHE": str(Path(demo_model_dir).parent), "PYTHONUNBUFFERED": "1"}
    env.pop("MAKELEVEL", None)
    env.pop("MAKEFLAGS", None)
    # -o: never reinstall from here, whatever the install stamp's age.
    cmd = ["make", "-C", str(repo), "-o", ".venv/.installed", "up", f"ARGS={args}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    children: list[psutil.Process] = []
    try:
        lines = _lines(proc)
        _wait_for(lines, "kubesgl: starting", 240)  # after this line `kubesgl up` is waiting for /ready
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any("nats-server" in " ".join(c.cmdline()) for c in children)
        proc.send_signal(signal.SIGINT)
        # Stopping a stack still loading takes seconds (no request to drain); before, make waited forever.
        assert proc.wait(60) == -signal.SIGINT  # make, its recipe done, dies of the signal it got
        _wait_for(lines, "kubesgl: make was signalled: stopping", 5)
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"orphans: {[p.cmdline() for p in alive]}"
    finally:
        _kill_if_running(proc, children)


def _pty_lines(fd: int) -> queue.Queue[str]:
    """The lines a terminal would show, read from a pty's master side."""
    lines: queue.Queue[str] = queue.Queue()

    def pump() -> None:
        with os.fdopen(fd, "rb", buffering=0) as master:
            pending = b""
            while True:
                try:
                    data = master.read(4096)
                except OSError:  # EIO: every process holding the terminal has exited
                    return
                if not data:
                    return
                *whole, pending = (pending + data).split(b"\n")
                for line in whole:
                    lines.put(line.decode(errors="replace") + "\n")

    threading.Thread(target=pump, daemon=True).start()
    return lines


def test_ctrl_c_in_a_terminal_lets_a_stream_in_flight_finish_then_stops_gateway_first(
    demo_model_dir: str,
) -> None:
    """Ctrl-C as a terminal sends it: SIGINT to the whole foreground process group of `make up` (make and the
    `kubesgl up` its recipe execs; the services run in sessions of their own, so they hear only the launcher's
    SIGTERM, in stop order). A stream in flight at that moment gets every token and its finish_reason; no
    other service is stopped until the gateway has sent it; make exits with the SIGINT (130 in a shell)."""
    repo = Path(__file__).resolve().parents[2]
    args = f"--port {free_port()} --base-port 0 --device cpu --scheduler-args '--num-pages 4096'"
    env = {**os.environ, "KUBESGL_CACHE": str(Path(demo_model_dir).parent), "PYTHONUNBUFFERED": "1"}
    env.pop("MAKELEVEL", None)
    env.pop("MAKEFLAGS", None)
    master, slave = pty.openpty()
    cmd = ["make", "-C", str(repo), "-o", ".venv/.installed", "up", f"ARGS={args}"]
    # A session of its own, on a terminal: its process group is what Ctrl-C signals.
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=env, start_new_session=True)
    os.close(slave)
    children: list[psutil.Process] = []
    try:
        lines = _pty_lines(master)
        banner = _wait_for(lines, "serving `demo` at", 240)
        base = banner.split(" at ", 1)[1].split()[0].removesuffix("/v1")
        children = psutil.Process(proc.pid).children(recursive=True)
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 64, "temperature": 0, "stream": True}
        body["stream_options"] = {"include_usage": True}
        texts, finish, usage = [], None, None
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line.removeprefix("data: "))
                assert "error" not in chunk, f"the stream failed during the stop: {chunk}"
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    texts += [choice["text"]] if choice.get("text") else []
                    finish = choice.get("finish_reason") or finish
                    if len(texts) == 1 and choice.get("text"):
                        os.killpg(proc.pid, signal.SIGINT)  # mid-stream: most of its tokens still to come
        assert finish == "length" and usage is not None and usage["completion_tokens"] == 64, (finish, usage)
        assert proc.wait(120) == -signal.SIGINT  # make dies of the signal once its recipe is done
        shown = []
        with contextlib.suppress(queue.Empty):
            while True:
                shown.append(lines.get(timeout=5))
        text = "".join(shown)
        assert "kubesgl: stopped" in text, text
        shown_lines = text.splitlines()
        served = next(i for i, line in enumerate(shown_lines) if "POST /v1/completions 200" in line)
        for service in ("tokenizer-0", "scheduler-0", "detokenizer-0"):
            stopped = next(
                i
                for i, line in enumerate(shown_lines)
                if line.startswith(f"{service} | ") and "SIGTERM received" in line
            )
            assert served < stopped, f"{service} was stopped before the gateway sent the stream:\n{text}"
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"orphans: {[p.cmdline() for p in alive]}"
    finally:
        _kill_if_running(proc, children)


def test_a_stream_still_open_when_the_gateway_drain_runs_out_ends_with_a_clear_503(
    demo_model_dir: str,
) -> None:
    """At the end of the gateway's --drain-timeout uvicorn cancels what is still open, which cut a stream off
    mid-body (the client read an incomplete chunked body, no error, no [DONE]); it now ends with a 503 error
    event and [DONE] before that."""
    port = free_port()
    proc = _up(demo_model_dir, port, "--gateway-args", "--drain-timeout 2")
    try:
        _wait_for(_lines(proc), "serving `demo` at", 240)
        body = {"model": "demo", "prompt": "Hello", "max_tokens": 4000, "temperature": 0, "stream": True}
        events = []
        url = f"http://127.0.0.1:{port}/v1/completions"
        with httpx.stream("POST", url, json=body, timeout=120) as reply:
            assert reply.status_code == 200
            for line in reply.iter_lines():
                if line.startswith("data: "):
                    events.append(line.removeprefix("data: "))
                    if len(events) == 1:
                        proc.send_signal(signal.SIGINT)
        assert events[-1] == "[DONE]", events[-3:]
        error = json.loads(events[-2])["error"]
        assert (
            error["type"] == "service_unavailable"
            and "the gateway shut down before the request finished" in error["message"]
        )
        assert proc.wait(90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_restarts_a_service_that_dies_and_ctrl_c_still_stops_everything(demo_model_dir: str) -> None:
    proc = _up(demo_model_dir, free_port(), "--gateways", "0")
    try:
        lines = _lines(proc)
        _wait_for(lines, "serving `demo`", 240)
        scheduler = next(
            c for c in psutil.Process(proc.pid).children(recursive=True) if "scheduler" in c.cmdline()
        )
        scheduler.kill()
        _wait_for(lines, "kubesgl: scheduler-0 exited with -9; restarting it in 1 s", 30)
        _wait_for(lines, "kubesgl: scheduler-0 is back (restart 1)", 240)
        children = psutil.Process(proc.pid).children(recursive=True)
        again = [c for c in children if "scheduler" in c.cmdline()]
        assert len(again) == 1 and again[0].pid != scheduler.pid
        assert proc.poll() is None, "the stack kept running"
        proc.send_signal(signal.SIGINT)
        assert proc.wait(90) == 0
        _, alive = psutil.wait_procs(children, timeout=10)
        assert alive == [], f"orphans: {[p.cmdline() for p in alive]}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_up_shows_the_last_lines_of_a_service_that_dies_while_starting(demo_model_dir: str) -> None:
    proc = _up(demo_model_dir, free_port(), "--scheduler-args=--no-such-flag")
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 1, out
    reason = out[out.index("kubesgl: scheduler-0 exited with 2 while starting:") :]
    assert "unrecognized arguments: --no-such-flag" in reason, out


def test_ports_are_planned_from_port_and_base_port_in_start_order(tmp_path: Path) -> None:
    config = StackConfig("m", "m", schedulers=2, detokenizers=1, tokenizers=2, gateways=2, base_port=8100)
    assert planned_ports(config) == {
        "gateway-0": 8000,
        "gateway-1": 8001,
        "scheduler-0": 8100,
        "scheduler-1": 8101,
        "detokenizer-0": 8102,
        "tokenizer-0": 8103,
        "tokenizer-1": 8104,
    }
    # A replica added later takes the next port up; free ports (0) plan nothing.
    assert Stack(config, tmp_path)._admin_port("tokenizer-2") == 8105
    assert planned_ports(StackConfig("m", "m", port=0)) == {}
    with pytest.raises(ValueError, match="scheduler-0 and gateway-1 would both listen on port 8001"):
        planned_ports(StackConfig("m", "m", gateways=2, base_port=8001))


def test_up_refuses_a_directory_that_is_not_a_model(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kubesgl.cli", "up", "--model", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0 and "is not a model directory (no config.json)" in out.stderr


def test_a_spawned_service_owns_its_port_before_it_runs(demo_model_dir: str, tmp_path: Path) -> None:
    """The launcher binds each service's port and hands the child the socket: no other process (a parallel
    test's stack) can take a port between its choice and the child's start, the failure a "free port"
    number allowed (the child died on EADDRINUSE while another stack's service answered its /ready)."""
    stack = Stack(StackConfig(demo_model_dir, "demo", port=0), tmp_path)
    stack.nats.start()
    try:
        gateway, detok = stack.spawn("gateway"), stack.spawn("detokenizer")
        ports = [urlsplit(s.ready_url).port for s in (gateway, detok)]
        # Right after Popen: the children are still importing Python, yet their ports are taken.
        assert all(p and not port_free("127.0.0.1", p) for p in ports), ports
        stack.wait_ready(120, ["detokenizer-0"])  # a gateway is ready only once a scheduler heartbeats
        assert http_ok(gateway.ready_url.replace("/ready", "/health"), timeout_s=10)
        detok.proc.kill()
        detok.proc.wait(10)
        # The launcher kept no copy of the socket: a dead service's port refuses (it does not hang probes).
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", ports[1]), timeout=2).close()
    finally:
        stack.stop(timeout_s=10)
