"""A scheduler with two tensor-parallel ranks (two processes) exports each request once: rank 0 owns the
metrics, so its counts match what the tokenizer and the clients saw, not twice that."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import httpx
import psutil
import pytest
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from kubesgl.launcher import Stack
from prometheus_client.parser import text_string_to_metric_families
from support.local_stack import model_name, stream_chat

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tp_stack(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(
        tmp_path_factory.mktemp("stack"), scheduler_args=(*TEST_SCHEDULER_ARGS, "--tp", "2")
    )
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


def samples(stack: Stack, kind: str) -> dict[str, float]:
    """name{labels} -> value from one service's /metrics, summed over label sets."""
    [svc] = [s for s in stack.services.values() if s.kind == kind]
    with urllib.request.urlopen(svc.ready_url.removesuffix("/ready") + "/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_tp2_scheduler_counts_each_request_once(tp_stack: Stack) -> None:
    completion_tokens = 0
    with httpx.Client(base_url=tp_stack.gateway_urls[0], timeout=120) as client:
        for prompt in ("first question", "a second, longer question about something"):
            events = stream_chat(client, model_name(tp_stack), prompt, 8, ignore_eos=True)
            completion_tokens += events[-1]["usage"]["completion_tokens"]
    # Two processes: the service (rank 0) and the rank-1 worker it spawned.
    [svc] = [s for s in tp_stack.services.values() if s.kind == "scheduler"]
    assert psutil.Process(svc.proc.pid).children(recursive=True)
    scheduler, tokenizer = samples(tp_stack, "scheduler"), samples(tp_stack, "tokenizer")
    assert scheduler["sglang:num_requests_total"] == 2
    assert scheduler["sglang:time_to_first_token_seconds_count"] == 2
    assert scheduler["sglang:generation_tokens_total"] == completion_tokens == 16
    assert scheduler["sglang:prompt_tokens_total"] == tokenizer["kubesgl_tokenizer_prompt_tokens_total"]
