"""Helpers for end-to-end telemetry and load tests over the local stack (conftest's stack_factory): where
each service serves /metrics, one streamed chat completion, and steady background load."""

from __future__ import annotations

import json
import threading

import httpx
from kubesgl.launcher import Stack


def model_name(stack: Stack) -> str:
    return stack.config.served_model_name


def metrics_targets(stack: Stack) -> dict[str, list[str]]:
    """Prometheus scrape targets (host:port serving /metrics), one job per service kind."""
    targets: dict[str, list[str]] = {}
    for svc in stack.services.values():
        hostport = svc.ready_url.removeprefix("http://").removesuffix("/ready")
        targets.setdefault(svc.kind, []).append(hostport)
    return targets


def stream_chat(
    client: httpx.Client, model: str, prompt: str, max_tokens: int, **extra: object
) -> list[dict]:
    """One streamed chat completion; its events (asserting HTTP 200 and a [DONE] end)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body |= {"stream": True, "stream_options": {"include_usage": True}, **extra}
    events, done = [], False
    with client.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
    assert done, "stream ended without [DONE]"
    return events


class BackgroundLoad:
    """`users` threads streaming chat completions back to back until stop(); counts outcomes."""

    def __init__(self, base_url: str, model: str, users: int, max_tokens: int) -> None:
        self.completed = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._user, args=(base_url, model, max_tokens, i), daemon=True)
            for i in range(users)
        ]

    def __enter__(self) -> BackgroundLoad:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)

    def _user(self, base_url: str, model: str, max_tokens: int, i: int) -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            n = 0
            while not self._stop.is_set():
                n += 1
                try:
                    stream_chat(
                        client, model, f"user {i} request {n}: tell me a story", max_tokens, ignore_eos=True
                    )
                except (AssertionError, httpx.HTTPError) as e:
                    with self._lock:
                        self.errors.append(f"{type(e).__name__}: {e}")
                else:
                    with self._lock:
                        self.completed += 1
