"""Soak: the local stack under mixed load for a bounded time, watched for leaks and for requests that hang or
vanish (docs/reliability.md, "Soak").

It starts the stack the tests start (`kubesgl.launcher.Stack`: nats-server + each service its own process, the
demo model, loopback only), then `--clients` closed-loop users send a seeded mix of requests until the time is
up: chat and completions, streamed or not, n=2, stop strings, logprobs, short and long prompts, prompts
sharing a long prefix, invalid bodies, clients that disconnect mid-stream or give up on a JSON answer, and
requests whose `X-Request-Timeout` expires mid-generation. Every request ends in exactly one bucket:

- completed: 200 with its end (a finish reason; `[DONE]` for a stream);
- failed clearly: an OpenAI error body (non-200) or an SSE error event before `[DONE]`, counted by status and
  type; `expected` ones are what the scenario asks for (400 for an invalid body, 504 for an expired deadline);
- disconnected: the client left on purpose (not a failure; the server must free the request);
- hung: no answer within the client's hard timeout (a deadline request: its deadline + `--deadline-margin`);
- lost: accepted but never finished (a stream cut or ended without its end, a 200 without a finish reason,
  an error without OpenAI's body).

Every `--sample-every` seconds it writes one JSON line with each service process's RSS and open fds (psutil,
children such as TP ranks included) and the counts so far; after the load, one line with the scheduler's
page pool (its stats subject) against the baseline taken before the load, and a summary line; then it prints
the summary. Exit status 0 only when nothing hung, nothing was lost and the pool is back to its baseline.

    .venv/bin/python loadtest/soak.py --minutes 15 --out soak.jsonl
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

import httpx
import nats
import psutil
from kubesgl.launcher import Stack, StackConfig
from kubesgl.models.random_init import DEMO, resolve_demo
from kubesgl.protocol import SchedulerStats, stats_subject

# The load generators' prompt vocabulary and SSE reader, beside this file (loadtest/ is no package).
sys.path.insert(0, str(Path(__file__).resolve().parent))
from sse_timing import StreamTimer  # noqa: E402
from workload import prompt_text  # noqa: E402

KINDS = ("completed", "failed_clearly", "disconnected", "hung", "lost")
MODEL = DEMO
# A small KV pool (the CPU default reserves 512 MiB) and a short drain, as the tests run the stack.
SCHEDULER_ARGS = ("--device", "cpu", "--num-pages", "8192", "--drain-timeout", "10")
# ~400 tokens every shared-prefix request starts with (a system prompt, as a real deployment has).
SHARED_PREFIX = "You are a careful assistant. " + prompt_text(400, random.Random(0))
_STATUS_OF_TYPE = {"service_unavailable": 503, "timeout": 504, "internal_error": 500}


@dataclass(frozen=True)
class Outcome:
    scenario: str
    kind: str  # one of KINDS
    started: float  # seconds since the load began
    seconds: float
    status: int | None = None  # HTTP status, or the error's status for a failure inside a stream
    error_type: str | None = None
    expected: bool = True  # False: a failure the scenario did not ask for
    late_s: float | None = None  # deadline requests: how long after the deadline the timeout came
    detail: str = ""


@dataclass(frozen=True)
class Request:
    path: str
    body: dict[str, Any]
    headers: dict[str, str]
    expect: frozenset[int] = frozenset()  # failure statuses the scenario asks for
    leave_after_chunks: int = 0  # stream: read this many events, then disconnect
    give_up_after_s: float = 0.0  # JSON: disconnect after this long
    deadline_s: float = 0.0  # X-Request-Timeout


def _words(rng: random.Random, n: int) -> str:
    return prompt_text(n, rng)


def _chat(content: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], **fields}


Scenario = Callable[[random.Random], Request]


def _scenarios() -> dict[str, tuple[int, Scenario]]:
    """name -> (weight, request builder)."""
    chat, cmpl = "/v1/chat/completions", "/v1/completions"
    none: dict[str, str] = {}
    return {
        "chat_json": (3, lambda r: Request(chat, _chat(_words(r, 12), max_tokens=16), none)),
        "chat_stream": (
            3,
            lambda r: Request(
                chat,
                _chat(_words(r, 20), max_tokens=24, stream=True, stream_options={"include_usage": True}),
                none,
            ),
        ),
        "completion_n2": (
            1,
            lambda r: Request(
                cmpl,
                {"model": MODEL, "prompt": _words(r, 16), "max_tokens": 12, "n": 2, "temperature": 0.8},
                none,
            ),
        ),
        "stop_strings": (
            1,
            lambda r: Request(
                cmpl,
                {
                    "model": MODEL,
                    "prompt": _words(r, 10),
                    "max_tokens": 24,
                    "stop": [" the", "\n"],
                    "stream": True,
                },
                none,
            ),
        ),
        "logprobs": (
            1,
            lambda r: Request(chat, _chat(_words(r, 8), max_tokens=8, logprobs=True, top_logprobs=2), none),
        ),
        "long_prompt": (
            1,
            lambda r: Request(cmpl, {"model": MODEL, "prompt": _words(r, 1500), "max_tokens": 8}, none),
        ),
        "shared_prefix": (
            2,
            lambda r: Request(
                chat,
                {
                    "model": MODEL,
                    "messages": [
                        {"role": "system", "content": SHARED_PREFIX},
                        {"role": "user", "content": _words(r, 6)},
                    ],
                    "max_tokens": 12,
                    "stream": r.random() < 0.5,
                },
                none,
            ),
        ),
        "invalid": (
            1,
            lambda r: Request(chat, _chat("x", max_tokens=8, temperature=-1), none, expect=frozenset({400})),
        ),
        "disconnect_stream": (
            1,
            lambda r: Request(
                cmpl,
                {
                    "model": MODEL,
                    "prompt": _words(r, 12),
                    "max_tokens": 400,
                    "ignore_eos": True,
                    "stream": True,
                },
                none,
                leave_after_chunks=r.randint(1, 4),
            ),
        ),
        "abort_json": (
            1,
            lambda r: Request(
                chat,
                _chat(_words(r, 12), max_tokens=400, ignore_eos=True),
                none,
                give_up_after_s=r.uniform(0.2, 1.0),
            ),
        ),
        "deadline": (1, _deadline),
    }


def _deadline(r: random.Random) -> Request:
    """A generation far longer than its X-Request-Timeout: the answer must be a timeout, on time."""
    timeout_s = round(r.uniform(0.5, 2.0), 2)
    return Request(
        "/v1/chat/completions",
        _chat(_words(r, 12), max_tokens=2000, ignore_eos=True, stream=r.random() < 0.5),
        {"X-Request-Timeout": str(timeout_s)},
        expect=frozenset({504}),
        deadline_s=timeout_s,
    )


class Soak:
    def __init__(
        self,
        stack: Stack,
        duration_s: float,
        clients: int,
        seed: int,
        out: TextIO,
        sample_every_s: float,
        request_timeout_s: float,
        deadline_margin_s: float,
    ) -> None:
        self.stack = stack
        self.duration_s = duration_s
        self.clients = clients
        self.rng = random.Random(seed)
        self.out = out
        self.sample_every_s = sample_every_s
        self.request_timeout_s = request_timeout_s
        self.deadline_margin_s = deadline_margin_s
        self.outcomes: list[Outcome] = []
        self.samples: list[dict[str, Any]] = []
        self._scenarios = _scenarios()
        self._names = list(self._scenarios)
        self._weights = [w for w, _ in self._scenarios.values()]
        self._first_pass = iter(self._names)  # every scenario once, however short the run, then the mix
        self._t0 = 0.0

    # -- the run ---------------------------------------------------------------------------------
    async def run(self) -> dict[str, Any]:
        instance = next(str(s.instance_id) for s in self.stack.services.values() if s.kind == "scheduler")
        limits = httpx.Limits(max_connections=self.clients * 2, max_keepalive_connections=self.clients)
        async with httpx.AsyncClient(base_url=self.stack.gateway_urls[0], limits=limits) as http:
            warm = await http.post("/v1/chat/completions", json=_chat("warm up", max_tokens=2), timeout=120)
            warm.raise_for_status()
            baseline = await _settled_stats(self.stack.nats_url, instance, None, timeout_s=30)
            self._t0 = time.monotonic()
            self._emit({"kind": "start", "baseline": asdict(baseline), "clients": self.clients})
            sampler = asyncio.create_task(self._sample_forever())
            end = self._t0 + self.duration_s
            await asyncio.gather(*(self._user(http, end) for _ in range(self.clients)))
            sampler.cancel()
        load_s = time.monotonic() - self._t0
        after = await _settled_stats(self.stack.nats_url, instance, baseline, timeout_s=30)
        self._sample()
        pool = {
            "baseline_available_pages": baseline.available_pages,
            "available_pages": after.available_pages,
            "total_pages": after.total_pages,
            "running": after.running,
            "queued": after.queued,
            "active_rids": len(after.active_rids),
            "back_to_baseline": _is_baseline(after, baseline),
        }
        self._emit({"kind": "pool", **pool})
        summary = self.summary(load_s, pool)
        self._emit({"kind": "summary", **summary})
        return summary

    async def _user(self, http: httpx.AsyncClient, end: float) -> None:
        while True:
            # The first pass runs to its end however short the run (or slow the box), then the clock rules.
            name = next(self._first_pass, None)
            if name is None:
                if time.monotonic() >= end:
                    return
                name = self.rng.choices(self._names, self._weights)[0]
            req = self._scenarios[name][1](self.rng)
            started = time.monotonic()
            hard = (req.deadline_s + self.deadline_margin_s) if req.deadline_s else self.request_timeout_s
            try:
                async with asyncio.timeout(hard):
                    outcome = await self._one(http, name, req, started)
            except TimeoutError:
                outcome = self._outcome(name, "hung", started, detail=f"no answer within {hard:.1f} s")
            self.outcomes.append(outcome)

    async def _one(self, http: httpx.AsyncClient, name: str, req: Request, started: float) -> Outcome:
        try:
            if req.body.get("stream"):
                return await self._stream(http, name, req, started)
            return await self._json(http, name, req, started)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            return self._outcome(name, "lost", started, detail=f"{type(e).__name__}: {e}")

    async def _json(self, http: httpx.AsyncClient, name: str, req: Request, started: float) -> Outcome:
        call = http.post(req.path, json=req.body, headers=req.headers, timeout=None)
        if req.give_up_after_s:
            try:
                r = await asyncio.wait_for(call, req.give_up_after_s)
            except TimeoutError:  # httpx closes the connection: the gateway sees the client leave
                return self._outcome(name, "disconnected", started)
        else:
            r = await call
        if r.status_code != 200:
            return self._refusal(name, req, started, r.status_code, r.content)
        choices = r.json().get("choices") or []
        if not choices or any(c.get("finish_reason") is None for c in choices):
            return self._outcome(name, "lost", started, 200, detail=f"200 without a finish: {r.text[:200]}")
        return self._outcome(name, "completed", started, 200)

    async def _stream(self, http: httpx.AsyncClient, name: str, req: Request, started: float) -> Outcome:
        timer = StreamTimer(started)
        async with http.stream("POST", req.path, json=req.body, headers=req.headers, timeout=None) as r:
            if r.status_code != 200:
                return self._refusal(name, req, started, r.status_code, await r.aread())
            async for line in r.aiter_lines():
                timer.on_line(line, time.monotonic())
                if timer.done:
                    break
                if req.leave_after_chunks and timer.chunks >= req.leave_after_chunks:
                    return self._outcome(name, "disconnected", started, 200)
        if timer.error_type is not None and timer.done:  # an SSE error event, then [DONE]: a clear failure
            status = _STATUS_OF_TYPE.get(timer.error_type, 400)
            return self._failure(name, req, started, status, timer.error_type, timer.error or "")
        if (why := timer.failure()) is not None:
            return self._outcome(name, "lost", started, 200, detail=why)
        return self._outcome(name, "completed", started, 200)

    def _refusal(self, name: str, req: Request, started: float, status: int, raw: bytes) -> Outcome:
        try:
            error = json.loads(raw)["error"]
            if error["message"] and error["type"]:
                return self._failure(name, req, started, status, error["type"], error["message"])
        except (ValueError, KeyError, TypeError):
            pass
        return self._outcome(name, "lost", started, status, detail=f"no OpenAI error body: {raw[:200]!r}")

    def _failure(
        self, name: str, req: Request, started: float, status: int, error_type: str | None, message: str
    ) -> Outcome:
        """A clear failure; its message (the server's words, never the prompt) goes in `detail`."""
        late = (time.monotonic() - started - req.deadline_s) if req.deadline_s and status == 504 else None
        expected = status in req.expect
        return self._outcome(
            name, "failed_clearly", started, status, error_type, expected, late, detail=message[:200]
        )

    def _outcome(
        self,
        name: str,
        kind: str,
        started: float,
        status: int | None = None,
        error_type: str | None = None,
        expected: bool = True,
        late_s: float | None = None,
        detail: str = "",
    ) -> Outcome:
        now = time.monotonic()
        return Outcome(
            name, kind, started - self._t0, now - started, status, error_type, expected, late_s, detail
        )

    # -- sampling and reporting ------------------------------------------------------------------
    async def _sample_forever(self) -> None:
        while True:
            self._sample()
            await asyncio.sleep(self.sample_every_s)

    def _sample(self) -> None:
        procs = {s.name: s.proc.pid for s in self.stack.services.values()}
        if self.stack.nats.proc is not None:
            procs["nats-server"] = self.stack.nats.proc.pid
        sample = {
            "kind": "sample",
            "t": round(time.monotonic() - self._t0, 1),
            "services": {name: _usage(pid) for name, pid in procs.items()},
            "counts": self.counts(),
        }
        self.samples.append(sample)
        self._emit(sample)

    def counts(self) -> dict[str, int]:
        c = Counter(o.kind for o in self.outcomes)
        return {"sent": len(self.outcomes), **{k: c[k] for k in KINDS}}

    def summary(self, load_s: float, pool: dict[str, Any]) -> dict[str, Any]:
        failed = [o for o in self.outcomes if o.kind == "failed_clearly"]
        late = [o.late_s for o in self.outcomes if o.late_s is not None]
        first, last = self.samples[0]["services"], self.samples[-1]["services"]
        # Memory after warm-up (allocator pools, caches, compiled kernels): a quarter into the run.
        warm = next(s for s in self.samples if s["t"] >= load_s / 4)["services"]
        resources = {
            name: {
                "rss_mb_first": first[name]["rss_mb"],
                "rss_mb_warm": warm.get(name, first[name])["rss_mb"],
                "rss_mb_last": last[name]["rss_mb"],
                "rss_mb_max": max(
                    s["services"][name]["rss_mb"] for s in self.samples if name in s["services"]
                ),
                "fds_first": first[name]["fds"],
                "fds_last": last[name]["fds"],
            }
            for name in first
            if name in last
        }
        return {
            "load_s": round(load_s, 1),
            "clients": self.clients,
            **self.counts(),
            "by_scenario": dict(Counter(o.scenario for o in self.outcomes)),
            "failed_clearly_by": dict(Counter(f"{o.status} {o.error_type}" for o in failed)),
            "unexpected_failures": [asdict(o) for o in failed if not o.expected][:10],
            "hung_or_lost": [asdict(o) for o in self.outcomes if o.kind in ("hung", "lost")][:10],
            "deadline_timeouts": len(late),
            "deadline_late_s_max": round(max(late), 3) if late else None,
            "deadline_late_over_0_5s": sum(x > 0.5 for x in late),
            "resources": resources,
            "pool": pool,
        }

    def _emit(self, record: dict[str, Any]) -> None:
        self.out.write(json.dumps(record) + "\n")
        self.out.flush()


def _usage(pid: int) -> dict[str, Any]:
    """RSS (MiB) and open fds of a process and its children (TP ranks, compile workers)."""
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {"rss_mb": 0.0, "fds": 0, "procs": 0}
    rss, fds, alive = 0, 0, 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
            alive += 1
        except psutil.NoSuchProcess:
            continue
    return {"rss_mb": round(rss / 2**20, 1), "fds": fds, "procs": alive}


def _is_baseline(s: SchedulerStats, baseline: SchedulerStats | None) -> bool:
    pages = baseline is None or s.available_pages == baseline.available_pages
    return s.running == 0 and s.queued == 0 and not s.active_rids and pages


async def _settled_stats(
    nats_url: str, instance: str, baseline: SchedulerStats | None, timeout_s: float
) -> SchedulerStats:
    """The scheduler's stats once nothing runs (and, given a baseline, the pool is back to it), or the last
    ones seen when `timeout_s` runs out."""
    nc = await nats.connect(nats_url)
    try:
        end = time.monotonic() + timeout_s
        while True:
            msg = await nc.request(stats_subject(instance), b"", timeout=10)
            s = SchedulerStats.from_bytes(msg.data)
            if _is_baseline(s, baseline) or time.monotonic() > end:
                return s
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def print_summary(s: dict[str, Any], file: TextIO = sys.stdout) -> None:
    p = s["pool"]
    print(
        f"\nsoak: {s['load_s']} s, {s['clients']} clients: {s['sent']} requests: {s['completed']} completed, "
        f"{s['failed_clearly']} failed clearly, {s['disconnected']} disconnected on purpose, "
        f"{s['hung']} hung, {s['lost']} lost",
        file=file,
    )
    if s["failed_clearly_by"]:
        print(
            "  failed clearly: " + ", ".join(f"{k} x{v}" for k, v in s["failed_clearly_by"].items()),
            file=file,
        )
    if s["unexpected_failures"]:
        print(f"  unexpected failures (first): {s['unexpected_failures'][:3]}", file=file)
    if s["deadline_timeouts"]:
        print(
            f"  deadlines: {s['deadline_timeouts']} answered with a timeout, latest "
            f"{s['deadline_late_s_max']} s after its deadline, {s['deadline_late_over_0_5s']} over 0.5 s",
            file=file,
        )
    print(f"  {'service':<14} {'RSS MiB first, warm → last (max)':>34} {'fds first → last':>18}", file=file)
    for name, r in s["resources"].items():
        rss = f"{r['rss_mb_first']:.0f}, {r['rss_mb_warm']:.0f} → {r['rss_mb_last']:.0f} ({r['rss_mb_max']:.0f})"
        print(f"  {name:<14} {rss:>34} {str(r['fds_first']) + ' → ' + str(r['fds_last']):>18}", file=file)
    print(
        f"  page pool: {p['available_pages']} of {p['total_pages']} available after the load "
        f"(baseline {p['baseline_available_pages']}), running {p['running']}, queued {p['queued']}: "
        f"{'back to baseline' if p['back_to_baseline'] else 'NOT back to baseline'}",
        file=file,
    )
    if s["hung_or_lost"]:
        print(f"  hung or lost (first): {s['hung_or_lost'][:3]}", file=file)


def ok(summary: dict[str, Any]) -> bool:
    return summary["hung"] == 0 and summary["lost"] == 0 and summary["pool"]["back_to_baseline"]


def run_soak(
    stack: Stack,
    duration_s: float,
    out: TextIO,
    clients: int = 6,
    seed: int = 0,
    sample_every_s: float = 10.0,
    request_timeout_s: float = 120.0,
    deadline_margin_s: float = 5.0,
) -> dict[str, Any]:
    """Drives an already started stack; returns the summary (also written to `out` as its last line)."""
    soak = Soak(stack, duration_s, clients, seed, out, sample_every_s, request_timeout_s, deadline_margin_s)
    return asyncio.run(soak.run())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    length = parser.add_mutually_exclusive_group()
    length.add_argument("--minutes", type=float, default=5.0, help="how long to load (at most 24 h)")
    length.add_argument("--seconds", type=float, help="how long to load, in seconds")
    parser.add_argument("--clients", type=int, default=6, help="concurrent closed-loop users")
    parser.add_argument("--seed", type=int, default=0, help="seeds the request mix")
    parser.add_argument("--sample-every", type=float, default=10.0, help="seconds between resource samples")
    parser.add_argument(
        "--request-timeout", type=float, default=120.0, help="a request's hard client timeout"
    )
    parser.add_argument(
        "--deadline-margin", type=float, default=5.0, help="a deadline request hangs past deadline + this"
    )
    parser.add_argument("--out", default=None, help="JSON lines file (default: stdout)")
    parser.add_argument("--schedulers", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument("--tokenizers", type=int, default=1)
    args = parser.parse_args(argv)
    duration_s = args.seconds if args.seconds is not None else args.minutes * 60
    if not 0 < duration_s <= 24 * 3600:
        parser.error("the soak runs for more than 0 s and at most 24 h")
    config = StackConfig(
        model_path=resolve_demo(DEMO),
        served_model_name=MODEL,
        schedulers=args.schedulers,
        detokenizers=args.detokenizers,
        tokenizers=args.tokenizers,
        port=0,  # free loopback ports: a soak never collides with a running `make up`
        scheduler_args=SCHEDULER_ARGS,
    )
    with tempfile.TemporaryDirectory(prefix="kubesgl-soak-") as workdir:
        stack = Stack(config, Path(workdir))
        try:
            stack.start()
            stack.wait_ready(300)
            out: TextIO = open(args.out, "w") if args.out else sys.stdout  # noqa: SIM115 - closed below
            try:
                summary = run_soak(
                    stack,
                    duration_s,
                    out,
                    clients=args.clients,
                    seed=args.seed,
                    sample_every_s=args.sample_every,
                    request_timeout_s=args.request_timeout,
                    deadline_margin_s=args.deadline_margin,
                )
            finally:
                if out is not sys.stdout:
                    out.close()
        finally:
            stack.stop(timeout_s=20)
    print_summary(summary, sys.stdout if args.out else sys.stderr)
    return 0 if ok(summary) else 1


if __name__ == "__main__":
    sys.exit(main())
