"""A live scheduler's /metrics carries SGLang's capacity and start-up gauges with the engine's real numbers:
the KV pool's size, the tokens in use, the requests preempted under memory pressure, and how long the
engine took to start and to load its weights."""

from __future__ import annotations

import asyncio
import urllib.request
from collections.abc import Iterator

import pytest
from conftest import TEST_SCHEDULER_ARGS, StackFactory
from kubesgl.launcher import Stack
from kubesgl.values.sampling import SamplingParams
from prometheus_client.parser import text_string_to_metric_families
from support.bus_client import BusClient
from support.waiting import wait_until

PAGES, PAGE_SIZE = 120, 4  # room for about two of the requests below at once: the scheduler must preempt


@pytest.fixture(scope="module")
def tight(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    args = (*TEST_SCHEDULER_ARGS, "--num-pages", str(PAGES), "--page-size", str(PAGE_SIZE))
    stack = stack_factory(tmp_path_factory.mktemp("stack"), scheduler_args=args, gateways=0)
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


def scrape(stack: Stack) -> dict[str, float]:
    """The scheduler's sglang:* samples by name, and "pages": the KV pool in tokens per cache_config_info."""
    [svc] = [s for s in stack.services.values() if s.kind == "scheduler"]
    with urllib.request.urlopen(svc.ready_url.removesuffix("/ready") + "/metrics", timeout=5) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sglang:cache_config_info":
                values["pages"] = float(s.labels["num_pages"]) * float(s.labels["page_size"])
            elif s.name.startswith("sglang:") and not s.name.endswith(("_bucket", "_created")):
                values[s.name] = s.value
    return values


async def load(stack: Stack) -> None:
    client = await BusClient.connect(stack.nats_url)
    try:
        params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
        prompts = [" ".join(f"word{(7 * i + j) % 97}" for j in range(12 + i)) for i in range(12)]
        streams = await asyncio.gather(
            *(client.generate(prompt=prompt, params=params, timeout_s=180) for prompt in prompts)
        )
        assert all(len(s.token_ids) == 24 for s in streams)
    finally:
        await client.close()


def test_capacity_startup_and_preemption_gauges(tight: Stack) -> None:
    before = scrape(tight)
    assert before["sglang:max_total_num_tokens"] == before["pages"] >= PAGES * PAGE_SIZE
    assert before["sglang:num_used_tokens"] == 0
    assert before["sglang:engine_startup_time"] > before["sglang:engine_load_weights_time"] > 0
    assert before["sglang:num_retracted_requests_total"] == 0
    asyncio.run(load(tight))
    # Stats reach the gauges with a later heartbeat: until one comes, a scrape still shows the idle engine of
    # before the load (0 used, 0 retracted), so wait for the load's preemptions to be counted, with nothing used.
    after = wait_until(
        lambda: (
            (s := scrape(tight))["sglang:num_retracted_requests_total"] > 0
            and s["sglang:num_used_tokens"] == 0
            and s
        ),
        "the twelve requests' preemptions are counted (room for two must preempt) and no token is in use",
        timeout_s=20,
        interval_s=0.2,
    )
    assert after["sglang:num_retracted_reqs"] >= 0
    assert after["sglang:max_total_num_tokens"] == before["sglang:max_total_num_tokens"]
