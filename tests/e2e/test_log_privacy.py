"""Prompts and outputs stay out of the logs by default: requests carrying a unique marker go through every
service of a live stack at the default log level (served, streamed, refused by the gateway, by the tokenizer,
and abandoned by the client mid-stream), and neither the marker nor any generated text appears in any
service's log — while the gateway's access line per request and the scheduler's periodic stats line, which
are there to be read, are."""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import httpx
from conftest import TEST_SCHEDULER_ARGS, StackFactory

MODEL = "demo"


def test_prompts_and_outputs_are_not_logged_at_the_default_level(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    marker = f"privacy-{uuid.uuid4().hex}"
    # A 1 s stats interval so the short load below spans at least one stats line.
    stack = stack_factory(
        tmp_path / "stack", scheduler_args=(*TEST_SCHEDULER_ARGS, "--stats-log-interval", "1")
    )
    assert stack.config.log_level == "info"  # the default of every service
    outputs: list[str] = []
    try:
        with httpx.Client(base_url=stack.gateway_urls[0], timeout=120) as http:
            chat = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{marker} chat"}],
                "max_tokens": 16,
            }
            r = http.post("/v1/chat/completions", json=chat)
            assert r.status_code == 200, r.text
            outputs.append(r.json()["choices"][0]["message"]["content"])
            body = {"model": MODEL, "prompt": f"{marker} completion", "max_tokens": 16, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as s:
                text = "".join(
                    json.loads(line[6:])["choices"][0]["text"]
                    for line in s.iter_lines()
                    if line.startswith("data: {") and '"choices":[{' in line
                )
            outputs.append(text)
            r = http.post(
                "/generate", json={"text": f"{marker} native", "sampling_params": {"max_new_tokens": 8}}
            )
            assert r.status_code == 200, r.text
            outputs.append(r.json()["text"])
            # Refusals: by the gateway (validation), by the tokenizer (context length).
            bad = {"model": MODEL, "prompt": marker, "temperature": f"{marker}-hot"}
            assert http.post("/v1/completions", json=bad).status_code == 400
            long = {"model": MODEL, "prompt": f"{marker} " * 2000, "max_tokens": 40000}
            assert http.post("/v1/completions", json=long).status_code == 400
            # A client that leaves mid-stream (the abort path).
            leave = {"model": MODEL, "prompt": f"{marker} leave", "max_tokens": 200, "stream": True}
            with http.stream("POST", "/v1/completions", json=leave) as s:
                next(s.iter_lines())
            # Busy for over a stats interval (a heartbeat samples the engine once a second).
            long_run = {"model": MODEL, "prompt": "busy", "max_tokens": 64, "ignore_eos": True}
            assert http.post("/v1/completions", json=long_run).status_code == 200
    finally:
        stack.stop(timeout_s=10)
    generated = [t for t in outputs if len(t.strip()) >= 8]  # long enough not to match by chance
    assert generated, outputs
    logs = {p.name: p.read_text(errors="replace") for p in Path(stack.workdir).glob("*.log")}
    assert {"gateway-0.log", "tokenizer-0.log", "scheduler-0.log", "detokenizer-0.log"} <= set(logs)
    for name, text in logs.items():
        assert marker not in text, f"{name} logged a prompt"
        assert not [t for t in generated if t in text], f"{name} logged generated text"
    access = [line for line in logs["gateway-0.log"].splitlines() if "kubesgl.gateway.access" in line]
    served = [line for line in access if "POST /v1/chat/completions 200 rid=chatcmpl-" in line]
    assert served and "completion_tokens=16" in served[0] and "prompt_tokens=" in served[0], access
    assert any("POST /v1/completions 400" in line for line in access), access
    assert any("POST /generate 200 rid=gen-" in line and "ttft=" in line for line in access), access
    assert not any("/ready" in line for line in access), "probes log at DEBUG only"
    assert '"POST /v1/chat/completions HTTP/1.1"' not in logs["gateway-0.log"], "uvicorn's access log is on"
    stats = [line for line in logs["scheduler-0.log"].splitlines() if "Stats. #running-req:" in line]
    assert stats and "gen throughput (token/s):" in stats[-1] and "cache hit rate:" in stats[-1], stats
