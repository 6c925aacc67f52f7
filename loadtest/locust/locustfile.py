"""Locust load test: users streaming chat completions, with time to first token and inter-token latency
reported as their own rows ("TTFT", "ITL") beside the HTTP request row.

    BASE_URL=http://127.0.0.1:8000 .venv/bin/locust -f loadtest/locust/locustfile.py --headless -u 8 -r 4 -t 60s
    (or: make loadtest-locust)

Knobs (environment): BASE_URL (or --host), API_KEY, MODEL (default: the first of /v1/models), PROMPT_MIX
("WORDS:WEIGHT,...", see workload.py), MAX_TOKENS (default 32), THINK_TIME (seconds between a user's requests,
default 0). Users, spawn rate and duration are locust's own -u/-r/-t. A failed stream (non-200, error event,
no [DONE], no finish_reason) is a locust failure, so `locust --headless` exits non-zero when any request failed.
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

from locust import HttpUser, constant, events, task

# The shared workload/timing modules sit one directory up; locust only puts this file's directory on sys.path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sse_timing import StreamTimer  # noqa: E402
from workload import DEFAULT_PROMPT_MIX, PromptMix, auth_headers, chat_body, prompt_text  # noqa: E402

API_KEY = os.environ.get("API_KEY", "")
PROMPT_MIX = PromptMix.parse(os.environ.get("PROMPT_MIX", DEFAULT_PROMPT_MIX))
MAX_TOKENS = int(os.environ.get("MAX_TOKENS", "32"))
_model = os.environ.get("MODEL", "")


class StreamingChatUser(HttpUser):
    """One client: streams a chat completion, measures it, repeats after THINK_TIME."""

    # BASE_URL as the default --host so the same variable drives k6, locust and replay.py.
    host = os.environ.get("BASE_URL")
    wait_time = constant(float(os.environ.get("THINK_TIME", "0")))

    def on_start(self) -> None:
        self.client.headers.update(auth_headers(API_KEY))
        self.rng = random.Random()
        self.model = _model or self._first_model()

    def _first_model(self) -> str:
        with self.client.get("/v1/models", name="/v1/models", catch_response=True) as resp:
            models = resp.json().get("data", []) if resp.status_code == 200 else []
            if not models:
                resp.failure(f"no model to test: /v1/models answered {resp.status_code}")
                raise RuntimeError("set MODEL: /v1/models lists none")
            return models[0]["id"]

    @task
    def stream_chat(self) -> None:
        prompt = prompt_text(PROMPT_MIX.pick(self.rng), self.rng)
        body = chat_body(self.model, prompt, MAX_TOKENS)
        start = time.perf_counter()
        timer = StreamTimer(start)
        with self.client.post(
            "/v1/chat/completions", json=body, stream=True, catch_response=True, name="/v1/chat/completions"
        ) as resp:
            if resp.status_code != 200:
                resp.failure(f"HTTP {resp.status_code}: {resp.text[:200]}")
                return
            for line in resp.iter_lines():
                timer.on_line(line, time.perf_counter())
            problem = timer.failure()
            if problem:
                resp.failure(problem)
                return
            resp.success()
        self._report("TTFT", timer.ttft)
        for gap in timer.itls:
            self._report("ITL", gap)

    def _report(self, kind: str, seconds: float | None) -> None:
        if seconds is None:
            return
        events.request.fire(
            request_type=kind,
            name=kind,
            response_time=seconds * 1000.0,
            response_length=0,
            exception=None,
            context={},
        )
