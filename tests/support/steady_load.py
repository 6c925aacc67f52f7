"""Steady streaming load against a gateway for the fault tests: `clients` concurrent users send greedy
completions back to back, each bounded by a hard client-side timeout, and every request is classified as
completed (text equals the offline reference), failed with a clear error (OpenAI error body or SSE error
event), hung (no end within the timeout) or lost (accepted but ended without its text, or with wrong text)."""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections import Counter
from dataclasses import dataclass

import httpx
from kubesgl.launcher import ServiceProcess, Stack

KINDS = ("completed", "failed_clearly", "hung", "lost")
# An SSE error event carries OpenAI's body but no HTTP status: its type names it (errors.py).
_BACKOFF_S = 0.2  # after a failure, as a client honouring Retry-After would (no busy loop of refusals)
_STATUS_OF_TYPE = {"service_unavailable": 503, "timeout": 504, "internal_error": 500}


@dataclass(frozen=True)
class Outcome:
    kind: str  # one of KINDS
    started: float  # monotonic
    ended: float
    status: int | None = None  # the error's status for failed_clearly
    detail: str = ""


class SteadyLoad:
    """`async with SteadyLoad(...) as load:` runs the users until the block ends, then lets every request in
    flight finish (each is bounded by `request_timeout_s`)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        expected: dict[str, str],
        clients: int = 8,
        max_tokens: int = 24,
        request_timeout_s: float = 60.0,
    ) -> None:
        self.base_url, self.model, self.expected = base_url, model, expected
        self.clients, self.max_tokens, self.request_timeout_s = clients, max_tokens, request_timeout_s
        self.outcomes: list[Outcome] = []
        self._prompts = itertools.cycle(expected)
        self._stop = asyncio.Event()
        self._users: list[asyncio.Task[None]] = []

    async def __aenter__(self) -> SteadyLoad:
        limits = httpx.Limits(max_connections=self.clients * 2)
        self._http = httpx.AsyncClient(base_url=self.base_url, limits=limits, timeout=self.request_timeout_s)
        self._users = [asyncio.create_task(self._user()) for _ in range(self.clients)]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        await asyncio.wait_for(asyncio.gather(*self._users), self.request_timeout_s + 10)
        await self._http.aclose()

    def counts(self) -> dict[str, int]:
        c = Counter(o.kind for o in self.outcomes)
        return {"sent": len(self.outcomes), **{k: c[k] for k in KINDS}}

    def summary(self) -> dict[str, object]:
        """The counts and, per kind that is not a completion, a few of its outcomes."""
        notes = {k: [o for o in self.outcomes if o.kind == k][:3] for k in KINDS[1:]}
        return {**self.counts(), **{k: v for k, v in notes.items() if v}}

    def completed_since(self, t: float) -> int:
        return sum(o.kind == "completed" and o.started >= t for o in self.outcomes)

    async def wait_completed(self, n: int, timeout_s: float) -> None:
        """Until `n` requests completed (the load is warm), or fails."""
        end = time.monotonic() + timeout_s
        while sum(o.kind == "completed" for o in self.outcomes) < n:
            assert time.monotonic() < end, (f"fewer than {n} completions in {timeout_s} s", self.summary())
            await asyncio.sleep(0.1)

    async def _user(self) -> None:
        while not self._stop.is_set():
            prompt = next(self._prompts)
            started = time.monotonic()
            try:
                async with asyncio.timeout(self.request_timeout_s):
                    kind, status, detail = await self._one(prompt)
            except TimeoutError:
                kind, status, detail = "hung", None, f"no end within {self.request_timeout_s} s"
            self.outcomes.append(Outcome(kind, started, time.monotonic(), status, detail))
            if kind != "completed":
                await asyncio.sleep(_BACKOFF_S)  # scenario timing: a client's backoff after a failure

    async def _one(self, prompt: str) -> tuple[str, int | None, str]:
        body = {"model": self.model, "prompt": prompt, "max_tokens": self.max_tokens, "temperature": 0}
        body |= {"stream": True}
        text, finish, error, done = "", None, None, False
        try:
            async with self._http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    return _refusal(r.status_code, await r.aread())
                async for line in r.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                    elif event.get("choices"):
                        text += event["choices"][0]["text"]
                        finish = event["choices"][0].get("finish_reason") or finish
        except httpx.TimeoutException:
            return "hung", None, f"no data for {self.request_timeout_s} s"
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return "lost", None, f"stream broke: {type(e).__name__}: {e}"
        if error is not None and error.get("message") and done:
            return "failed_clearly", _STATUS_OF_TYPE.get(error.get("type")), error["message"]
        if not done or finish is None:
            return "lost", None, f"stream ended without its end (done={done}, finish={finish})"
        if text != self.expected[prompt]:
            return "lost", None, f"wrong text for {prompt!r}: {text!r} != {self.expected[prompt]!r}"
        return "completed", None, ""


def _refusal(status: int, raw: bytes) -> tuple[str, int | None, str]:
    """A non-200 answer is a clear failure only if it carries OpenAI's error body."""
    try:
        error = json.loads(raw)["error"]
        if error["message"] and error["type"]:
            return "failed_clearly", status, error["message"]
    except (ValueError, KeyError, TypeError):
        pass
    return "lost", status, f"HTTP {status} without an OpenAI error body: {raw[:200]!r}"


def live(stack: Stack, kind: str) -> list[ServiceProcess]:
    return [s for s in stack.services.values() if s.kind == kind and s.proc.poll() is None]


def ensure_replicas(stack: Stack, kind: str, n: int, timeout_s: float = 180.0) -> None:
    """Starts replicas of `kind` until `n` are alive, and waits for them to be ready."""
    new = [stack.spawn(kind).name for _ in range(n - len(live(stack, kind)))]
    if new:
        stack.wait_ready(timeout_s, new)
