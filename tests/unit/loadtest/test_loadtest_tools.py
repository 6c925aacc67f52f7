"""The load-test tools without a server: trace generation and replay timing, stream timing, the prompt mix,
and that k6 and locust accept their scripts (runs against the stack are in test_loadtest_stack.py)."""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

LOADTEST = Path(__file__).resolve().parents[3] / "loadtest"
BIN = Path(sys.executable).parent
sys.path.insert(0, str(LOADTEST))

from replay import load_trace, percentile, send_offsets, synthetic_trace  # noqa: E402
from sse_timing import StreamTimer  # noqa: E402
from workload import PromptMix, chat_body, prompt_text  # noqa: E402


def test_synthetic_trace_has_poisson_arrivals_at_the_rate() -> None:
    trace = synthetic_trace(4000, rate=5.0, input_len=100, output_len=20, spread=0.5, seed=1)
    gaps = [b.timestamp - a.timestamp for a, b in zip(trace, trace[1:], strict=False)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    # Exponential gaps: the standard deviation equals the mean.
    assert statistics.stdev(gaps) == pytest.approx(0.2, rel=0.1)
    assert all(50 <= r.input_len <= 150 and 10 <= r.output_len <= 30 for r in trace)
    assert synthetic_trace(10, 5.0, 100, 20, 0.5, seed=1) == trace[:10]


def test_bad_synthetic_parameters_are_rejected() -> None:
    for args in ((0, 1.0, 10, 10, 0.5), (10, 0.0, 10, 10, 0.5), (10, 1.0, 10, 10, 1.0)):
        with pytest.raises(ValueError):
            synthetic_trace(*args, seed=0)


def test_trace_file_reads_mooncake_rows_in_milliseconds(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    rows = [
        {"timestamp": 1500, "input_length": 30, "output_length": 5, "hash_ids": [1, 2]},
        {"timestamp": 500, "input_len": 10, "output_len": 3},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    trace = load_trace(path, "ms")
    assert [(r.timestamp, r.input_len, r.output_len) for r in trace] == [(0.5, 10, 3), (1.5, 30, 5)]


def test_bad_trace_row_is_named_by_line(tmp_path: Path) -> None:
    path = tmp_path / "trace.jsonl"
    path.write_text('{"timestamp": 0, "input_len": 3, "output_len": 2}\n{"timestamp": 1, "input_len": 3}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:2"):
        load_trace(path)
    path.write_text('{"timestamp": 0, "input_len": 0, "output_len": 2}\n')
    with pytest.raises(ValueError, match=r"trace.jsonl:1: input_len"):
        load_trace(path)


def test_time_scale_stretches_arrival_gaps() -> None:
    trace = synthetic_trace(5, rate=1.0, input_len=8, output_len=8, spread=0.0, seed=3)
    normal, fast = send_offsets(trace, 1.0), send_offsets(trace, 0.5)
    assert normal[0] == 0.0
    assert fast == pytest.approx([t / 2 for t in normal])
    with pytest.raises(ValueError):
        send_offsets(trace, 0.0)


def test_percentiles_interpolate() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0, 1.0, 2.0, 4.0], 50) == pytest.approx(2.5)
    assert percentile([1.0, 2.0, 3.0, 4.0, 5.0], 90) == pytest.approx(4.6)


def chat_event(content: str | None = None, finish: str | None = None, usage: dict | None = None) -> str:
    choice = {"index": 0, "delta": {"content": content} if content else {}, "finish_reason": finish}
    event: dict = {"choices": [choice] if content or finish else []}
    if usage:
        event["usage"] = usage
    return "data: " + json.dumps(event)


def test_stream_timer_measures_first_token_and_gaps() -> None:
    timer = StreamTimer(start=10.0)
    timer.on_line(chat_event(), 10.1)  # role-only chunk: no token yet
    timer.on_line("", 10.1)
    timer.on_line(chat_event("Hel"), 10.5)
    timer.on_line(chat_event("lo"), 10.7)
    timer.on_line(b'data: {"choices": [{"index": 0, "text": "!", "finish_reason": "length"}]}', 11.0)
    timer.on_line(chat_event(usage={"completion_tokens": 3}), 11.0)
    timer.on_line("data: [DONE]", 11.0)
    assert timer.ttft == pytest.approx(0.5)
    assert timer.itls == pytest.approx([0.2, 0.3])
    assert (timer.chunks, timer.completion_tokens, timer.finish_reason) == (3, 3, "length")
    assert timer.failure() is None


def test_stream_timer_reports_why_a_stream_failed() -> None:
    cut = StreamTimer(0.0)
    cut.on_line(chat_event("a"), 0.1)
    assert cut.failure() == "stream ended without [DONE]"
    errored = StreamTimer(0.0)
    errored.on_line('data: {"error": {"message": "scheduler gone", "code": 503}}', 0.1)
    errored.on_line("data: [DONE]", 0.1)
    assert errored.failure() == "scheduler gone"
    garbage = StreamTimer(0.0)
    garbage.on_line("data: {not json", 0.1)
    assert "malformed" in (garbage.failure() or "")


def test_prompt_mix_parses_and_picks_by_weight() -> None:
    mix = PromptMix.parse("16:3, 128:1")
    assert (mix.lengths, mix.weights) == ((16, 128), (3.0, 1.0))
    rng = random.Random(0)
    picks = [mix.pick(rng) for _ in range(4000)]
    assert picks.count(16) / len(picks) == pytest.approx(0.75, abs=0.03)
    assert PromptMix.parse("64").lengths == (64,)
    for bad in ("", "x:1", "16:0", "0:1", "16:abc"):
        with pytest.raises(ValueError, match="PROMPT_MIX"):
            PromptMix.parse(bad)
    words = prompt_text(40, rng).split()
    assert len(words) == 41 and chat_body("m", "p", 8)["stream"] is True


def k6_inspect(*env: str) -> subprocess.CompletedProcess[str]:
    args = [str(BIN / "k6"), "inspect"]
    for e in env:
        args += ["-e", e]
    return subprocess.run(
        [*args, str(LOADTEST / "k6" / "chat_stream.js")], capture_output=True, text=True, timeout=60
    )


def test_k6_script_has_bounded_load_and_thresholds() -> None:
    done = k6_inspect("VUS=8", "DURATION=30s", "TTFT_P95_MS=900")
    assert done.returncode == 0, done.stderr
    options = json.loads(done.stdout)
    assert options["scenarios"]["chat_stream"]["vus"] == 8
    assert options["scenarios"]["chat_stream"]["duration"] == "30s"
    thresholds = options["thresholds"]
    assert thresholds["http_req_failed"] == ["rate<=0"]
    assert thresholds["stream_errors"] == ["rate<=0"]
    assert thresholds["ttft"] == ["p(95)<900"]
    assert "itl" in thresholds


@pytest.mark.parametrize("bad", ["VUS=0", "VUS=5000", "DURATION=forever", "DURATION=48h", "PROMPT_MIX=1x:2"])
def test_k6_script_rejects_bad_knobs(bad: str) -> None:
    done = k6_inspect(bad)
    assert bad.split("=")[0] in done.stdout + done.stderr
    assert '"scenarios"' not in done.stdout


def test_locust_loads_the_streaming_user() -> None:
    done = subprocess.run(
        [str(BIN / "locust"), "-f", str(LOADTEST / "locust" / "locustfile.py"), "--list"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "StreamingChatUser" in done.stdout
