"""The NATS side end to end with a real nats-server and every service as its own OS process (2 tokenizers,
2 detokenizers, 1 scheduler on the demo model); a raw NATS client plays the gateway's part of the protocol."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import urllib.request
from collections.abc import Iterator

import psutil
import pytest
from conftest import StackFactory
from kubesgl import protocol as p
from kubesgl.engine.llm import LLM
from kubesgl.launcher import Stack
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.values.sampling import LogprobOptions, SamplingParams
from support.bus_client import BusClient, Stream
from support.waiting import wait_until_async

pytestmark = pytest.mark.timeout(180)

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
PROMPTS = ["Hello, my name is", "用中文写一首关于大海的诗 🌊", "def fibonacci(n):"]
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hi 👋 in 中文"}]


@pytest.fixture(scope="module")
def mesh(stack_factory: StackFactory, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(tmp_path_factory.mktemp("bus"), tokenizers=2, detokenizers=2, gateways=0)
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def offline(demo_model_dir: str) -> Iterator[LLM]:
    llm = LLM(demo_model_dir, num_pages=8192)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tokenizer(demo_model_dir: str) -> ModelTokenizer:
    return ModelTokenizer.load(demo_model_dir)


@pytest.fixture
async def client(mesh: Stack) -> BusClient:
    c = await BusClient.connect(mesh.nats_url)
    yield c
    await c.close()


def _scheduler_id(stack: Stack) -> str:
    return next(s for s in stack.services.values() if s.kind == "scheduler" and s.proc.poll() is None).name


def _metric(stack: Stack, service: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` carrying `labels` on a service's /metrics."""
    url = stack.services[service].ready_url.replace("/ready", "/metrics")
    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(r"([^{ ]+)(?:\{(.*)\})? (\S+)", line)
        if (
            m
            and m.group(1) == name
            and labels.items() <= dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or "")).items()
        ):
            total += float(m.group(3))
    return total


def _ensure_replicas(stack: Stack, kind: str, n: int) -> None:
    live = [s for s in stack.services.values() if s.kind == kind and s.proc.poll() is None]
    for _ in range(n - len(live)):
        stack.wait_ready(120, [stack.spawn(kind).name])


async def test_streamed_text_equals_offline_greedy_output(
    client: BusClient, offline: LLM, tokenizer: ModelTokenizer
) -> None:
    expected = offline.generate(PROMPTS, GREEDY)
    streams = await asyncio.gather(*(client.generate(prompt=pr, params=GREEDY) for pr in PROMPTS))
    for stream, want in zip(streams, expected, strict=True):
        assert stream.token_ids == want["token_ids"]
        assert stream.text == want["text"] == tokenizer.decode(want["token_ids"])
        last = stream.last
        assert (last.finish_reason, last.completion_tokens) == (want["finish_reason"], len(want["token_ids"]))
        assert last.prompt_tokens == want["prompt_tokens"]


async def test_chat_template_is_applied_before_generation(
    client: BusClient, offline: LLM, tokenizer: ModelTokenizer
) -> None:
    ids = tokenizer.render_chat(CHAT)
    assert tokenizer.decode(ids).startswith("system\nYou are terse.")  # special tokens skipped in decode
    (want,) = offline.generate([ids], GREEDY)
    stream = await client.generate(kind="chat", messages=CHAT, params=GREEDY)
    assert stream.token_ids == want["token_ids"]
    assert stream.text == tokenizer.decode(want["token_ids"])
    assert stream.last.prompt_tokens == len(ids)


async def test_logprobs_carry_token_strings_and_bytes(client: BusClient, tokenizer: ModelTokenizer) -> None:
    params = SamplingParams(
        max_tokens=6,
        temperature=0.0,
        logprobs=LogprobOptions(top=2),
    )
    stream = await client.generate(prompt=PROMPTS[1], params=params)
    entries = [lp for d in stream.ordered for lp in (d.logprobs or [])]
    assert [e.token_id for e in entries] == stream.token_ids
    for e in entries:
        assert e.token_bytes == tokenizer.token_bytes(e.token_id)
        assert e.token == tokenizer.token_text(e.token_id)
        assert len(e.top) == 2 and e.top[0][1] >= e.top[1][1]
        assert e.top[0][0] == e.token_id  # greedy picks the best
        assert e.top_tokens == tuple(tokenizer.token_text(t) for t, _ in e.top)


@pytest.mark.parametrize(
    ("request_fields", "status", "code", "message"),
    [
        ({"model": "nope"}, 404, "model_not_found", "The model `nope` does not exist."),
        ({"params": SamplingParams(max_tokens=40960)}, 400, "context_length_exceeded",
         "This model's maximum context length is 40960 tokens. However, you requested 40965 tokens "
         "(5 in the prompt, 40960 in the completion)."),
        ({"prompt": ""}, 400, None, "prompt must not be empty"),
        ({"sampling": {"temperature": -1.0}}, 400, None, "temperature must be >= 0"),
        ({"sampling": {"best_of": 2}}, 400, None, "unsupported sampling parameter(s): best_of"),
        ({"kind": "tokens", "prompt": None, "input_ids": [1, 10**7]}, 400, None, "outside the vocabulary"),
        ({"kind": "chat", "prompt": None, "messages": [{"role": "user", "content": 5}]}, 400, None,
         "messages[0].content must be str"),
        ({"deadline_s": -1.0}, 504, None, "deadline passed"),
        ({"rid": "two words"}, 400, None, "invalid request id"),
    ],
)  # fmt: skip
async def test_bad_requests_get_a_clear_error_reply(
    client: BusClient, request_fields: dict, status: int, code: str | None, message: str
) -> None:
    fields = {"prompt": PROMPTS[0], **request_fields}
    reply = await client.submit(**fields)
    assert isinstance(reply, p.ErrorReply), reply
    assert (reply.error.status, reply.error.code) == (status, code)
    assert message in reply.error.message


async def test_malformed_tokenize_body_is_refused(client: BusClient) -> None:
    msg = await client.nc.request(p.TOKENIZE, b"\x93not a map", timeout=5, headers=p.headers("r-bad"))
    reply = p.ErrorReply.from_bytes(msg.data)
    assert (reply.rid, reply.error.status) == ("r-bad", 400)


async def test_repeated_admission_is_idempotent(client: BusClient, mesh: Stack) -> None:
    sched = _scheduler_id(mesh)
    before = _metric(mesh, sched, "sglang:num_requests_total")
    params = SamplingParams(max_tokens=8, temperature=0.0)
    first = await client.submit(prompt=PROMPTS[0], params=params, rid="same-rid-1")
    again = await client.submit(prompt=PROMPTS[0], params=params, rid="same-rid-1")
    assert isinstance(first, p.Admitted) and again == first
    stream = await client.result("same-rid-1")
    assert len(stream.token_ids) == 8
    await wait_until_async(
        lambda: _metric(mesh, sched, "sglang:num_requests_total") > before, "the scheduler counts the request"
    )
    assert _metric(mesh, sched, "sglang:num_requests_total") == before + 1


async def test_an_abort_that_overtakes_its_admission_wins(client: BusClient) -> None:
    await client.nc.publish(p.ABORT, p.Abort(rid="aborted-early").to_bytes())
    await client.nc.flush()
    # Scenario timing: the abort is let ahead of the admission (a scheduler shows no sign of an early abort).
    await asyncio.sleep(0.2)
    reply = await client.submit(prompt=PROMPTS[0], params=GREEDY, rid="aborted-early")
    assert isinstance(reply, p.ErrorReply) and reply.error.status == 400
    assert reply.error.message == "request aborted-early was aborted before it was admitted"


async def test_abort_frees_pages(client: BusClient, mesh: Stack) -> None:
    instance = mesh.services[_scheduler_id(mesh)].instance_id
    baseline = await client.scheduler_stats(instance)
    params = SamplingParams(max_tokens=30000, temperature=0.0, ignore_eos=True)
    reply = await client.submit(prompt=PROMPTS[1] * 20, params=params)
    assert isinstance(reply, p.Admitted)
    stream = client.streams[reply.rid]
    await wait_until_async(lambda: len(stream.deltas) >= 3, "3 deltas stream", timeout_s=10.0)
    busy = await client.scheduler_stats(instance)
    assert busy.running == 1 and reply.rid in busy.active_rids
    assert busy.available_pages < baseline.available_pages
    await client.nc.publish(p.ABORT, p.Abort(rid=reply.rid).to_bytes())

    async def freed() -> p.SchedulerStats | None:
        stats = await client.scheduler_stats(instance)
        return stats if stats.running == 0 and stats.available_pages == baseline.available_pages else None

    stats = await wait_until_async(
        freed, "the aborted request's pages are free", timeout_s=5.0, interval_s=0.05
    )
    assert (stats.running, stats.queued, stats.active_rids) == (0, 0, [])
    assert stats.available_pages == baseline.available_pages
    n = len(stream.deltas)
    await asyncio.sleep(0.5)  # quiet window: a delta sent after the abort would arrive within it
    assert len(stream.deltas) == n and not stream.done.is_set()  # nothing more goes to the gateway


async def test_killing_a_detokenizer_mid_stream_breaks_no_stream(
    client: BusClient, mesh: Stack, tokenizer: ModelTokenizer
) -> None:
    _ensure_replicas(mesh, "detokenizer", 2)
    params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
    sched = _scheduler_id(mesh)

    def detok_timeouts() -> float:
        return _metric(
            mesh, sched, "kubesgl_nats_request_duration_seconds_count", target="detok", outcome="timeout"
        )

    before = detok_timeouts()
    # A generous deadline: this test is about the kill, and a loaded 2-core CI box streams slowly.
    replies = await asyncio.gather(
        *(client.submit(prompt=pr, params=params, deadline_s=300) for pr in PROMPTS)
    )
    streams = [client.streams[r.rid] for r in replies]
    await wait_until_async(lambda: all(s.deltas for s in streams), "every stream has its first delta", 60)
    victim = next(s for s in mesh.services.values() if s.kind == "detokenizer" and s.proc.poll() is None)
    # Stopped first: once a delivery to it times out, it surely holds a delta it will never ack.
    victim.proc.send_signal(signal.SIGSTOP)
    await wait_until_async(
        lambda: detok_timeouts() != before, "a delta reached the stopped replica", 30, interval_s=0.05
    )
    assert not all(s.done.is_set() for s in streams), "the kill must land mid-stream"
    victim.proc.kill()
    victim.proc.wait()
    for reply in replies:
        stream = await client.result(reply.rid, timeout_s=120)
        assert sorted(stream.deltas) == list(range(len(stream.deltas)))  # every seq arrived
        assert len(stream.token_ids) == stream.last.completion_tokens == 200
        assert stream.text == tokenizer.decode(stream.token_ids)
        assert stream.last.finish_reason == "length" and stream.last.error is None


async def test_killing_a_tokenizer_loses_no_request(
    client: BusClient, mesh: Stack, offline: LLM, tokenizer: ModelTokenizer
) -> None:
    _ensure_replicas(mesh, "tokenizer", 2)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    prompts = [f"{PROMPTS[i % 3]} #{i}" for i in range(16)]
    expected = offline.generate(prompts, params)
    victim = next(s for s in mesh.services.values() if s.kind == "tokenizer" and s.proc.poll() is None)
    victim.proc.send_signal(signal.SIGSTOP)  # requests queue up in its socket, then die with it

    async def kill_soon() -> None:
        await asyncio.sleep(0.5)  # scenario timing: requests queue up at the stopped replica meanwhile
        victim.proc.kill()

    killer = asyncio.create_task(kill_soon())
    replies = await asyncio.gather(
        *(client.submit(prompt=pr, params=params, attempt_timeout_s=2.0) for pr in prompts)
    )
    await killer
    assert all(isinstance(r, p.Admitted) for r in replies), replies
    assert max(client.attempts[r.rid] for r in replies) > 1  # some requests were lost and retried
    for reply, want in zip(replies, expected, strict=True):
        stream = await client.result(reply.rid)
        assert stream.token_ids == want["token_ids"]
        assert stream.text == tokenizer.decode(want["token_ids"])
    victim.proc.wait()


async def test_services_survive_a_nats_restart(client: BusClient, mesh: Stack) -> None:
    live = [s.name for s in mesh.services.values() if s.proc.poll() is None]

    def reconnects() -> dict[str, float]:
        return {name: _metric(mesh, name, "kubesgl_nats_reconnects_total") for name in live}

    before = reconnects()
    mesh.nats.restart()

    async def admitted() -> p.Admitted | None:
        try:
            reply = await client.submit(prompt=PROMPTS[0], params=GREEDY, attempt_timeout_s=1.0, attempts=1)
        except TimeoutError:
            return None
        return reply if isinstance(reply, p.Admitted) else None

    reply = await wait_until_async(
        admitted, "a request is admitted after the NATS restart", 30, interval_s=0.2
    )
    stream = await client.result(reply.rid)
    assert len(stream.token_ids) == GREEDY.max_tokens
    # Replicas that served nothing may still be in their reconnect backoff.
    await wait_until_async(
        lambda: all(reconnects()[name] > before[name] for name in live),
        f"every replica counts its reconnect (before: {before})",
        10,
        interval_s=0.2,
    )


async def test_sigterm_drains_a_tp2_scheduler_while_another_serves(
    client: BusClient, mesh: Stack, tokenizer: ModelTokenizer
) -> None:
    """Also: the instance's queue bound (2 running, 0 queued) refuses a third request with 503."""
    limits = ("--max-running-requests", "2", "--max-queued-requests", "0")
    draining = mesh.spawn("scheduler", extra_args=("--drain-timeout", "8", "--tp", "2", *limits))
    mesh.wait_ready(180, [draining.name])
    assert draining.instance_id is not None
    ranks = psutil.Process(draining.proc.pid).children(recursive=True)
    assert any("spawn_main" in " ".join(r.cmdline()) for r in ranks)  # rank 1 runs in its own process
    ids = tokenizer.encode(PROMPTS[0])

    async def generate_on(instance: str, rid: str, params: SamplingParams) -> p.Admitted | p.ErrorReply:
        # Straight to that instance, as a tokenizer would after routing.
        req = p.GenerateRequest(rid, client.gateway_id, ids, params, time.time() + 60)
        client.streams.setdefault(rid, Stream())
        msg = await client.nc.request(p.generate_subject(instance), req.to_bytes(), timeout=10)
        return p.decode(msg.data, p.Admitted, p.ErrorReply)

    short = await generate_on(
        draining.instance_id, "drain-short", SamplingParams(max_tokens=24, temperature=0.0)
    )
    endless_params = SamplingParams(max_tokens=30000, temperature=0.0, ignore_eos=True)
    endless = await generate_on(draining.instance_id, "drain-endless", endless_params)
    assert isinstance(short, p.Admitted) and isinstance(endless, p.Admitted)
    full = await generate_on(draining.instance_id, "drain-full", GREEDY)  # before "short" can finish
    assert isinstance(full, p.ErrorReply) and full.error.status == 503 and "is full" in full.error.message
    await wait_until_async(lambda: client.streams["drain-endless"].deltas, "the endless request streams", 60)
    draining.proc.send_signal(signal.SIGTERM)

    async def drains() -> bool:
        return (await client.scheduler_stats(draining.instance_id)).draining

    await wait_until_async(drains, "the scheduler drains on SIGTERM", 10, interval_s=0.05)
    refused = await generate_on(draining.instance_id, "drain-late", GREEDY)
    assert isinstance(refused, p.ErrorReply) and (refused.error.status, refused.error.message) == (
        503,
        f"scheduler instance {draining.instance_id} is draining",
    )
    elsewhere = await client.submit(prompt=PROMPTS[0], params=GREEDY)
    assert isinstance(elsewhere, p.Admitted) and elsewhere.instance_id != draining.instance_id
    done = await client.result("drain-short", 15)
    assert len(done.token_ids) == 24 and done.last.error is None
    cut = await client.result("drain-endless", 15)
    assert cut.last.error.status == 503
    assert "shut down before the request finished" in cut.last.error.message
    assert await asyncio.to_thread(draining.proc.wait, 30) == 0
    _, alive = psutil.wait_procs(ranks, timeout=10)
    assert alive == []  # the TP rank stopped with its scheduler
    assert len((await client.result(elsewhere.rid)).token_ids) == GREEDY.max_tokens


async def test_a_dead_engine_process_takes_its_scheduler_down_clearly(
    client: BusClient, mesh: Stack, tokenizer: ModelTokenizer
) -> None:
    """The engine runs in a child process of the scheduler (--engine-process, the default): SIGKILL it and the
    service process fails its in-flight request, says why in its log, and exits 1 (no half-alive pod)."""
    doomed = mesh.spawn("scheduler")
    mesh.wait_ready(180, [doomed.name])
    assert doomed.instance_id is not None
    children = psutil.Process(doomed.proc.pid).children()
    engine = [c for c in children if "resource_tracker" not in " ".join(c.cmdline())]
    assert len(engine) == 1 and "spawn_main" in " ".join(engine[0].cmdline())
    req = p.GenerateRequest(
        "engine-dies",
        client.gateway_id,
        tokenizer.encode(PROMPTS[0]),
        SamplingParams(max_tokens=30000, temperature=0.0, ignore_eos=True),
        time.time() + 60,
    )
    client.streams.setdefault(req.rid, Stream())
    msg = await client.nc.request(p.generate_subject(doomed.instance_id), req.to_bytes(), timeout=10)
    assert isinstance(p.decode(msg.data, p.Admitted, p.ErrorReply), p.Admitted)
    await wait_until_async(lambda: client.streams[req.rid].deltas, "the request streams", 60)
    engine[0].kill()
    failed = await client.result(req.rid, 30)
    assert failed.last.error is not None and "engine failed" in failed.last.error.message
    assert await asyncio.to_thread(doomed.proc.wait, 30) == 1
    assert f"the engine process (pid {engine[0].pid}) exited with code -9" in doomed.log_tail()
