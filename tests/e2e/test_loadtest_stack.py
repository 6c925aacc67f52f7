"""The load tests run against the local stack: k6 and locust for ~20 s each and a short trace replay, every
request streamed, with 0 failed requests."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import StackFactory
from kubesgl.launcher import Stack
from support.local_stack import model_name

pytestmark = pytest.mark.slow

LOADTEST = Path(__file__).resolve().parents[2] / "loadtest"
BIN = Path(sys.executable).parent
RUN_S = 20
# Latency thresholds loose enough for a 2-core CI runner shared with other tests; errors must be 0.
CI_THRESHOLDS = {"TTFT_P95_MS": "60000", "ITL_P95_MS": "10000", "E2E_P95_MS": "120000", "MAX_ERROR_RATE": "0"}


@pytest.fixture(scope="module")
def stack(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = stack_factory(tmp_path_factory.mktemp("stack"), detokenizers=2)
    try:
        yield s
    finally:
        s.stop(timeout_s=10)


def run(args: list[str], env: dict[str, str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(args, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s)


def test_k6_streams_for_20s_without_failures(stack: Stack, tmp_path: Path) -> None:
    summary = tmp_path / "summary.json"
    env = {
        "BASE_URL": stack.gateway_urls[0],
        "MODEL": model_name(stack),
        "VUS": "3",
        "DURATION": f"{RUN_S}s",
        "MAX_TOKENS": "16",
        "PROMPT_MIX": "8:3,64:1",
        **CI_THRESHOLDS,
    }
    script = str(LOADTEST / "k6" / "chat_stream.js")
    args = [str(BIN / "k6"), "run", "--no-usage-report", "--quiet", f"--summary-export={summary}", script]
    done = run(args, env, timeout_s=RUN_S + 120)
    assert done.returncode == 0, done.stderr[-4000:] + done.stdout[-2000:]
    metrics = json.loads(summary.read_text())["metrics"]
    assert metrics["http_reqs"]["count"] >= 3
    assert metrics["http_req_failed"]["value"] == 0
    assert metrics["stream_errors"]["value"] == 0
    assert metrics["checks"]["fails"] == 0
    assert metrics["ttft"]["p(95)"] > 0 and metrics["itl"]["avg"] > 0
    # MODEL is given, so every request is a chat stream: 16 tokens each, fewer where EOS came first.
    assert 0 < metrics["completion_tokens"]["count"] <= 16 * metrics["http_reqs"]["count"]


def test_locust_streams_for_20s_without_failures(stack: Stack, tmp_path: Path) -> None:
    env = {
        "BASE_URL": stack.gateway_urls[0],
        "MODEL": model_name(stack),
        "MAX_TOKENS": "16",
        "PROMPT_MIX": "8:3,64:1",
    }
    locustfile = str(LOADTEST / "locust" / "locustfile.py")
    args = [str(BIN / "locust"), "-f", locustfile, "--headless", "-u", "3", "-r", "3", "-t", f"{RUN_S}s"]
    args += ["--stop-timeout", "60", "--only-summary", "--csv", str(tmp_path / "run")]
    done = run(args, env, timeout_s=RUN_S + 150)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    with (tmp_path / "run_stats.csv").open() as f:
        rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(f)}
    aggregated = next(r for (_, name), r in rows.items() if name == "Aggregated")
    chat = rows[("POST", "/v1/chat/completions")]
    assert int(chat["Request Count"]) >= 3 and int(chat["Failure Count"]) == 0
    assert int(rows[("TTFT", "TTFT")]["Request Count"]) == int(chat["Request Count"])
    assert int(rows[("ITL", "ITL")]["Request Count"]) > 0
    assert int(aggregated["Failure Count"]) == 0


def test_trace_replay_completes_every_request(stack: Stack, tmp_path: Path) -> None:
    out = tmp_path / "replay.json"
    args = [sys.executable, str(LOADTEST / "replay.py"), "--synthetic", "--num-requests", "10", "--rate", "2"]
    args += ["--input-len", "48", "--output-len", "12", "--spread", "0.5", "--time-scale", "1.0"]
    args += ["--base-url", stack.gateway_urls[0], "--out", str(out)]
    done = run(args, {}, timeout_s=240)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    summary, requests = result["summary"], result["requests"]
    assert (summary["requests"], summary["completed"], summary["failed"]) == (10, 10, 0)
    assert summary["ttft_s"]["p50"] > 0 and summary["tbt_s"]["p90"] > 0
    # ignore_eos: each request produced exactly the trace's output length.
    assert all(r["completion_tokens"] == r["output_len"] for r in requests)
    # Open loop: requests went out at their arrival times, not after the previous one finished.
    assert requests[-1]["sent_at"] < 20


@pytest.mark.parametrize("target", ["loadtest-k6", "loadtest-locust"])
def test_make_loadtest_runs_the_venvs_tool_against_a_running_stack(stack: Stack, target: str) -> None:
    """`make loadtest-k6` / `make loadtest-locust` as the README has them, bounded by DURATION."""
    venv = str(BIN.parent)  # the venv running the tests: CI's is the repo's .venv, as `make up` uses
    args = ["make", "-s", "-C", str(LOADTEST.parent), target, f"VENV={venv}"]
    args += [f"BASE_URL={stack.gateway_urls[0]}", "DURATION=5s", "USERS=2"]
    done = run(args, {"MODEL": model_name(stack), "MAX_TOKENS": "8", **CI_THRESHOLDS}, timeout_s=180)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout + done.stderr
    assert ("http_reqs" in out) if target == "loadtest-k6" else ("/v1/chat/completions" in out), out[-2000:]
