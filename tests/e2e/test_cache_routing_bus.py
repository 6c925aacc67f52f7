"""Cache-aware routing end to end: two scheduler instances of the demo model, real nats-server, every service
its own process. A multi-turn chat workload (shared system prompt, growing history, conversations
interleaved) stays on the instance holding each conversation's prefix and gets more cached prompt tokens
than round-robin; a tokenizer started late catches up from snapshots; a killed instance leaves the index
and traffic continues on the other."""

from __future__ import annotations

import re
import signal
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from conftest import StackFactory
from kubesgl import protocol as p
from kubesgl.launcher import ServiceProcess, Stack
from kubesgl.values.sampling import SamplingParams
from support.bus_client import BusClient
from support.waiting import wait_until

SYSTEM = " ".join(f"Rule {i}: answer about topic {i * 7 % 13} politely and precisely." for i in range(24))
TOPICS = ("sailing boats", "baking bread", "prime numbers")
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)


@dataclass
class Conversation:
    system: str
    topic: str
    messages: list[dict[str, str]] = field(default_factory=list)
    instances: list[str] = field(default_factory=list)
    cached: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.messages = [{"role": "system", "content": self.system}]


async def _turn(client: BusClient, conv: Conversation) -> None:
    n = len(conv.instances)
    details = " ".join(f"point {n}.{k} on {conv.topic}" for k in range(16))
    conv.messages.append({"role": "user", "content": f"Question {n}: tell me more about {details}."})
    reply = await client.submit(kind="chat", messages=conv.messages, params=PARAMS)
    assert isinstance(reply, p.Admitted), reply
    stream = await client.result(reply.rid, timeout_s=60)
    assert stream.last.error is None and stream.last.finished, stream.last
    conv.messages.append({"role": "assistant", "content": stream.text})
    conv.instances.append(reply.instance_id)
    conv.cached.append(stream.last.cached_tokens)


async def _chat(client: BusClient, convs: list[Conversation], turns: int) -> None:
    for _ in range(turns):  # conversations interleaved, turn by turn
        for conv in convs:
            await _turn(client, conv)


def _metrics(svc: ServiceProcess) -> str:
    with urllib.request.urlopen(svc.ready_url.replace("/ready", "/metrics"), timeout=5) as r:
        return r.read().decode()


def _sample(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")) if m else {}
        if m and m.group(1) == name and labels.items() <= found.items():
            return float(m.group(3))
    return None


def _tokenizer(stack: Stack, policy: str, synced_with: int) -> ServiceProcess:
    """A tokenizer with `policy`, ready and (cache-aware) holding a snapshot of `synced_with` instances."""
    svc = stack.spawn("tokenizer", ("--routing-policy", policy))
    stack.wait_ready(120, [svc.name])
    # Ready once it heard one scheduler. Cache-aware: the snapshot of each instance it heard is the event to
    # wait for; round-robin shows no sign of which schedulers it heard, so it gets a heartbeat and a half.
    if policy != "cache-aware":
        time.sleep(1.5 * p.HEARTBEAT_INTERVAL_S)
    else:
        wait_until(
            what=f"{svc.name} snapshots {synced_with} instances",
            timeout_s=20.0,
            interval_s=0.2,
            predicate=lambda: (
                (_sample(_metrics(svc), "kubesgl_router_kv_snapshots_total", outcome="ok") or 0)
                >= synced_with
            ),
        )
    return svc


def _stop(svc: ServiceProcess) -> None:
    svc.proc.send_signal(signal.SIGTERM)
    svc.proc.wait(30)


async def test_cache_aware_routing_follows_prefixes_survives_a_kill_and_catches_up_late(
    stack_factory: StackFactory, tmp_path: Path
) -> None:
    stack = stack_factory(tmp_path / "stack", schedulers=2, tokenizers=0, gateways=0)
    schedulers = {s.instance_id: s for s in stack.services.values() if s.kind == "scheduler"}
    client = await BusClient.connect(stack.nats_url)
    try:
        # The same workload shape twice, each with its own system prompt so neither run reuses the other's cache.
        rr_tok = _tokenizer(stack, "round-robin", 0)
        rr = [Conversation("Round robin. " + SYSTEM, t) for t in TOPICS]
        await _chat(client, rr, turns=4)
        _stop(rr_tok)

        ca_tok = _tokenizer(stack, "cache-aware", 2)
        ca = [Conversation("Cache aware. " + SYSTEM, t) for t in TOPICS]
        await _chat(client, ca, turns=4)
        for conv in ca:  # every later turn runs where the conversation's history is cached
            assert set(conv.instances) == {conv.instances[0]}, conv.instances
        for conv in rr:
            assert len(set(conv.instances)) == 2  # round-robin alternates them
        assert sum(sum(c.cached[1:]) for c in ca) > sum(sum(c.cached[1:]) for c in rr) * 1.2, (
            [c.cached for c in ca],
            [c.cached for c in rr],
        )
        text = _metrics(ca_tok)
        assert (
            _sample(text, "kubesgl_router_decisions_total", policy="cache-aware", outcome="prefix") or 0
        ) >= 9
        assert (_sample(text, "kubesgl_router_prefix_overlap_ratio_count") or 0) >= 12

        # A tokenizer started now learns the caches from snapshots, with no request seen.
        holder = ca[0].instances[0]
        late = _tokenizer(stack, "cache-aware", 2)
        assert (_sample(_metrics(late), "kubesgl_router_index_blocks", scheduler_instance=holder) or 0) > 0
        _stop(ca_tok)
        for conv in ca:
            await _turn(client, conv)
            assert conv.instances[-1] == conv.instances[0]
            assert conv.cached[-1] > conv.cached[-2]  # the whole previous turn is reused

        # Kill the instance holding the conversations: it leaves the index and the others carry on.
        schedulers[holder].proc.kill()
        other = next(i for i in schedulers if i != holder)
        wait_until(
            what=f"{holder} leaves the routing index",
            timeout_s=20.0,
            interval_s=0.2,
            predicate=lambda: (
                _sample(_metrics(late), "kubesgl_router_index_blocks", scheduler_instance=holder) is None
            ),
        )
        for conv in ca:
            await _turn(client, conv)
            assert conv.instances[-1] == other
    finally:
        await client.close()
