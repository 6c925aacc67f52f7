"""The gateway's transport over a real nats-server, with the tokenizer/scheduler/detokenizer replaced by
FakeMeshForGatewayTest (these tests are about the gateway: ordering, duplicates, instance adoption, retries,
vanished schedulers, stop strings, aborts, auth and limits). The gateway runs as its own OS process."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import nats
import pytest
from kubesgl.errors import ServiceUnavailableError
from kubesgl.launcher import free_port
from kubesgl.protocol import (
    ABORT,
    HEARTBEAT,
    TOKENIZE,
    TOKENIZER_QUEUE,
    Abort,
    Admitted,
    ErrorInfo,
    ErrorReply,
    Heartbeat,
    SchedulerStats,
    TextDelta,
    TextDeltaBatch,
    TokenizeRequest,
    TokenLogprob,
    gateway_subject,
    stats_subject,
)
from kubesgl.runtime.nats_server import NatsServer
from nats.aio.client import Client
from nats.aio.msg import Msg
from support.gateway_helpers import GatewayProcess, wait_http
from support.waiting import wait_until_async

MODEL = "fake-model"


@pytest.fixture(scope="module")
def nats_srv(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def nats_url(nats_srv: NatsServer) -> str:
    return nats_srv.url


def _gateway(nats_url: str, tmp: Path, *args: str) -> Iterator[GatewayProcess]:
    gw = GatewayProcess(nats_url, tmp, "--tokenize-attempt-timeout", "0.5", *args)
    try:
        gw.wait_healthy()
        yield gw
    finally:
        gw.stop()


@pytest.fixture(scope="module")
def gateway(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    yield from _gateway(nats_url, tmp_path_factory.mktemp("gw"))


Plan = Callable[[TokenizeRequest], list[TextDelta]]


class FakeMeshForGatewayTest:
    """Answers tokenize requests like tokenizer + scheduler would (Admitted or ErrorReply), heartbeats like a
    scheduler, and plays the TextDeltas `plan` returns to the gateway, as a detokenizer would."""

    def __init__(self, nc: Client, instance: str = "sched-a", context_len: int = 64) -> None:
        self.nc, self.instance, self.context_len = nc, instance, context_len
        self.plan: Plan = lambda req: [_delta(req.rid, self.instance, 0, "hi", finished=True)]
        self.reply: Callable[[TokenizeRequest], Admitted | ErrorReply | None] = lambda req: Admitted(
            rid=req.rid, instance_id=self.instance, prompt_tokens=3
        )
        self.before_reply: Callable[[TokenizeRequest], Awaitable[None]] | None = None
        self.requests: list[TokenizeRequest] = []
        self.aborts: list[Abort] = []
        self.active: set[str] = set()  # rids the fake scheduler reports as running
        self.stats_answered = 0  # SchedulerStats replies sent (the gateway's post-reconnect audit asks)
        self.heartbeating = True
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await self.nc.subscribe(TOKENIZE, queue=TOKENIZER_QUEUE, cb=self._on_tokenize)
        await self.nc.subscribe(ABORT, cb=self._on_abort)
        await self.nc.subscribe(stats_subject(self.instance), cb=self._on_stats)
        self._tasks.append(asyncio.create_task(self._heartbeat()))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        await self.nc.close()

    async def _heartbeat(self) -> None:
        while True:
            if self.heartbeating:
                hb = Heartbeat(
                    self.instance, MODEL, self.context_len, 1, 100, 0, 0, 100, 100, 8, False, time.time()
                )
                await self.nc.publish(HEARTBEAT, hb.to_bytes())
            await asyncio.sleep(0.3)  # scenario timing: the fake scheduler's heartbeat period

    async def _on_tokenize(self, msg: Msg) -> None:
        req = TokenizeRequest.from_bytes(msg.data)
        self.requests.append(req)
        reply = self.reply(req)
        if reply is None:
            return  # a lost reply: the gateway must retry
        if self.before_reply is not None:
            await self.before_reply(req)
        await msg.respond(reply.to_bytes())
        if isinstance(reply, Admitted):
            self.active.add(req.rid)
            self._tasks.append(asyncio.create_task(self._play(req)))

    async def _play(self, req: TokenizeRequest) -> None:
        for delta in self.plan(req):
            await self.nc.publish(gateway_subject(req.gateway_id), delta.to_bytes())
            await asyncio.sleep(0.01)  # scenario timing: deltas arrive spaced, as a decode loop sends them

    async def _on_stats(self, msg: Msg) -> None:
        stats = SchedulerStats(self.instance, len(self.active), 0, 100, 100, 100, 0, sorted(self.active))
        await msg.respond(stats.to_bytes())
        self.stats_answered += 1

    async def _on_abort(self, msg: Msg) -> None:
        self.aborts.append(Abort.from_bytes(msg.data))

    def aborted(self, rid: str) -> list[Abort]:
        return [a for a in self.aborts if a.rid == rid]


def _delta(rid: str, instance: str, seq: int, text: str, finished: bool = False, **kw: object) -> TextDelta:
    return TextDelta(
        rid=rid,
        instance_id=instance,
        seq=seq,
        text=text,
        token_ids=kw.pop("token_ids", [100 + seq]),  # type: ignore[arg-type]
        finished=finished,
        finish_reason=kw.pop("finish_reason", "length" if finished else None),  # type: ignore[arg-type]
        prompt_tokens=3,
        completion_tokens=kw.pop("completion_tokens", seq + 1),  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


async def _mesh_for(
    gw: GatewayProcess, nats_url: str, instance: str = "sched-a", headers: dict[str, str] | None = None
) -> FakeMeshForGatewayTest:
    mesh = FakeMeshForGatewayTest(await nats.connect(nats_url), instance)
    await mesh.start()
    async with httpx.AsyncClient(headers=headers) as client:

        async def serves_model() -> bool:
            r = await client.get(f"{gw.url}/v1/models")
            return any(m["id"] == MODEL for m in r.json()["data"])

        await wait_until_async(serves_model, "the gateway saw the fake scheduler's heartbeat", interval_s=0.1)
    return mesh


@pytest.fixture
async def mesh(gateway: GatewayProcess, nats_url: str) -> AsyncIterator[FakeMeshForGatewayTest]:
    m = await _mesh_for(gateway, nats_url)
    yield m
    await m.stop()


async def _sse(response: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def _chat(**kw: object) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kw}


async def test_out_of_order_and_duplicate_deltas_reach_the_client_in_order(gateway, mesh) -> None:
    mesh.plan = lambda req: [
        _delta(req.rid, mesh.instance, 2, "c"),
        _delta(req.rid, mesh.instance, 0, "a"),
        _delta(req.rid, mesh.instance, 1, "b"),
        _delta(req.rid, mesh.instance, 1, "b"),
        _delta(req.rid, mesh.instance, 0, "a"),
        _delta(req.rid, mesh.instance, 3, "d", finished=True),
    ]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 4})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["choices"][0]["text"] == "abcd" and body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 4 and body["usage"]["prompt_tokens"] == 3
        async with client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s:
            events = await _sse(s)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == "abcd"
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_a_client_that_stops_reading_gets_every_byte_in_order_once_it_reads_again(
    gateway, mesh
) -> None:
    # The client's socket takes a few KB and it reads nothing while 12 MB of deltas arrive: the gateway's kernel
    # buffer fills, uvicorn pauses its writer and a write waits (SseWriter hands it to a task), and every delta
    # that comes meanwhile queues behind it. Once the client reads, all of it arrives, in order.
    mesh.plan = lambda req: []
    texts = [f"<{i:05d}>" + "x" * 3993 for i in range(3000)]
    host, port = gateway.url.removeprefix("http://").split(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.setblocking(False)
    await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
    reader, writer = await asyncio.open_connection(sock=sock, limit=4096)
    body = json.dumps({"model": MODEL, "prompt": "x", "max_tokens": 5000, "stream": True}).encode()
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    asked = len(mesh.requests)
    await wait_until_async(lambda: len(mesh.requests) > asked, "the request reached the mesh")
    req = mesh.requests[-1]
    subject = gateway_subject(req.gateway_id)
    for start in range(0, len(texts), 10):  # NATS messages of 10 deltas (40 KB), as a detokenizer batches
        batch = [_delta(req.rid, mesh.instance, i, texts[i]) for i in range(start, start + 10)]
        await mesh.nc.publish(subject, TextDeltaBatch(batch).to_bytes())
    last = _delta(req.rid, mesh.instance, len(texts), "end", finished=True)
    await mesh.nc.publish(subject, last.to_bytes())
    await mesh.nc.flush()
    await asyncio.sleep(1.0)  # the gateway takes every delta while the client still reads nothing
    raw = await asyncio.wait_for(_read_until_done(reader), 60)
    writer.close()
    events = [line[6:] for line in _dechunked(raw).decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert text == "".join(texts) + "end"


def _dechunked(raw: bytes) -> bytes:
    """An HTTP/1.1 response's body, from its chunked transfer encoding."""
    _, _, rest = raw.partition(b"\r\n\r\n")
    body = bytearray()
    while True:
        size_line, _, rest = rest.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return bytes(body)
        body += rest[:size]
        rest = rest[size + 2 :]


async def _read_until_done(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    while not out.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n"):
        chunk = await reader.read(1 << 16)
        if not chunk:
            break
        out += chunk
    return bytes(out)


async def test_deltas_queued_while_a_stream_writes_go_out_as_one_chunk_and_a_later_one_alone(
    gateway, mesh
) -> None:
    # Three deltas in one TextDeltaBatch (one NATS message) are all queued before the stream's next write: one
    # SSE chunk carries them. A delta that arrives after that chunk went out is a chunk of its own.
    mesh.plan = lambda req: []
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=20) as client,
        client.stream("POST", "/v1/chat/completions", json=_chat(stream=True, logprobs=True)) as s,
    ):
        req = mesh.requests[-1]
        first = [
            _delta(req.rid, mesh.instance, i, t, logprobs=[TokenLogprob(100 + i, -1.0)])
            for i, t in enumerate("abc")
        ]
        await mesh.nc.publish(gateway_subject(req.gateway_id), TextDeltaBatch(first).to_bytes())
        lines = s.aiter_lines()
        chunks = []
        async for line in lines:
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                if chunks[-1]["choices"][0]["delta"].get("content"):
                    break
        last = _delta(req.rid, mesh.instance, 3, "d", finished=True, logprobs=[TokenLogprob(103, -1.0)])
        await mesh.nc.publish(gateway_subject(req.gateway_id), last.to_bytes())
        chunks += [json.loads(x[6:]) async for x in lines if x.startswith("data: {")]
    contents = [c["choices"][0]["delta"].get("content") for c in chunks[1:]]
    assert contents == ["abc", "d"]
    assert [len(c["choices"][0]["logprobs"]["content"]) for c in chunks[1:]] == [3, 1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def test_deltas_from_a_second_instance_are_dropped_and_that_instance_aborted(gateway, mesh) -> None:
    async def foreign_first(req: TokenizeRequest) -> None:
        # A duplicate admission elsewhere streams before our Admitted arrives.
        await mesh.nc.publish(
            gateway_subject(req.gateway_id), _delta(req.rid, "sched-z", 0, "WRONG").to_bytes()
        )
        await mesh.nc.flush()
        # Scenario timing: the gateway gives no sign of a delta for a rid not yet admitted, so the Admitted is
        # held back a while for the foreign delta to land first (were it late, the test would still pass).
        await asyncio.sleep(0.2)

    mesh.before_reply = foreign_first
    mesh.plan = lambda req: [
        _delta(req.rid, "sched-z", 1, "WRONG"),
        _delta(req.rid, mesh.instance, 0, "ok", finished=True),
    ]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.json()["choices"][0]["text"] == "ok"
    rid = mesh.requests[-1].rid
    await wait_until_async(
        lambda: any(a.instance_id == "sched-z" for a in mesh.aborted(rid)), "the foreign instance is aborted"
    )


async def test_a_lost_admission_reply_is_retried_with_the_same_rid(gateway, mesh) -> None:
    seen: list[str] = []

    def drop_first(req: TokenizeRequest) -> Admitted | None:
        seen.append(req.rid)
        return None if len(seen) == 1 else Admitted(rid=req.rid, instance_id=mesh.instance, prompt_tokens=3)

    mesh.reply = drop_first
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        r = await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "hi"
    assert len(seen) == 2 and seen[0] == seen[1]


async def test_refusals_keep_their_status_and_openai_body(gateway, mesh) -> None:
    mesh.reply = lambda req: ErrorReply(
        rid=req.rid,
        error=ErrorInfo(
            status=400,
            type="invalid_request_error",
            code="context_length_exceeded",
            param="messages",
            message="too long",
        ),
    )
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        r = await client.post("/v1/chat/completions", json=_chat(stream=True))
        assert r.status_code == 400
        assert r.json() == {
            "error": {
                "message": "too long",
                "type": "invalid_request_error",
                "param": "messages",
                "code": "context_length_exceeded",
            }
        }
        r = await client.post("/v1/chat/completions", json={**_chat(), "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


async def _rest_after_silencing(gw: GatewayProcess, mesh: FakeMeshForGatewayTest) -> list[dict | str]:
    """A chat stream read up to its "partial" delta; then the mesh's instance stops heartbeating, and what the
    stream says after that (its events, then "[DONE]")."""
    async with (
        httpx.AsyncClient(base_url=gw.url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s,
    ):
        lines = s.aiter_lines()
        async for line in lines:
            if "partial" in line:
                break
        mesh.heartbeating = False
        return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]" async for x in lines if x]


async def test_a_vanished_scheduler_ends_the_stream_with_a_clear_error(gateway, nats_url) -> None:
    mesh = await _mesh_for(gateway, nats_url, instance="sched-dies")
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "partial")]  # then silence
    # No other instance takes the migrated request: it fails as before migration existed, naming the instance.
    mesh.reply = lambda req: (
        ErrorReply.from_error(req.rid, ServiceUnavailableError("no scheduler is available"))
        if req.output_ids
        else Admitted(rid=req.rid, instance_id=mesh.instance, prompt_tokens=3)
    )
    try:
        started = time.monotonic()
        rest = await _rest_after_silencing(gateway, mesh)
        assert rest[-1] == "[DONE]"
        assert (
            rest[-2]["error"]["type"] == "service_unavailable"
            and "sched-dies" in rest[-2]["error"]["message"]
        )
        assert time.monotonic() - started < 10
    finally:
        await mesh.stop()


async def test_a_vanished_schedulers_stream_moves_to_another_instance(gateway, nats_url) -> None:
    """Migration: the request is admitted again with the token ids streamed so far, under a new rid, and the
    client's stream goes on with the new instance's text, one id, usage from the new instance."""
    mesh = await _mesh_for(gateway, nats_url, instance="sched-gone")
    mesh.reply = lambda req: Admitted(
        rid=req.rid, instance_id="sched-next" if req.output_ids else mesh.instance, prompt_tokens=3
    )
    mesh.plan = lambda req: (
        [_delta(req.rid, "sched-next", 0, " world", finished=True, token_ids=[101], completion_tokens=2)]
        if req.output_ids
        else [_delta(req.rid, mesh.instance, 0, "Hello")]  # then silence
    )

    async def next_heartbeats() -> None:
        while True:
            hb = Heartbeat("sched-next", MODEL, 64, 1, 100, 0, 0, 100, 100, 8, False, time.time())
            await mesh.nc.publish(HEARTBEAT, hb.to_bytes())
            await asyncio.sleep(0.3)  # scenario timing: the second instance's heartbeat period

    beating = asyncio.create_task(next_heartbeats())
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=30) as client,
            client.stream(
                "POST",
                "/v1/chat/completions",
                json=_chat(stream=True, stream_options={"include_usage": True}),
            ) as s,
        ):
            lines = s.aiter_lines()
            events = []
            async for line in lines:
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                if "Hello" in line:
                    break
            mesh.heartbeating = False
            rest = [x async for x in lines if x.startswith("data: ") and x != "data: [DONE]"]
            events += [json.loads(x[6:]) for x in rest]
        assert not any("error" in e for e in events), events
        text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
        assert text == "Hello world"
        assert len({e["id"] for e in events}) == 1
        assert events[-1]["usage"]["completion_tokens"] == 2
        first, resumed = mesh.requests[-2], mesh.requests[-1]
        assert resumed.rid == f"{first.rid}~m1" and resumed.output_ids == [100]
        assert (resumed.messages, resumed.sampling) == (first.messages, first.sampling)
        assert [a.instance_id for a in mesh.aborted(first.rid)] == ["sched-gone"]
    finally:
        beating.cancel()
        await mesh.stop()


async def test_a_migration_that_would_pause_the_stream_past_its_budget_fails_clearly(
    nats_url: str, tmp_path: Path
) -> None:
    """--max-migration-seconds bounds the pause migrations add to a stream (from its last delta to the resumed
    admission): declaring an instance dead alone takes its heartbeat expiry (seconds), past a 1 s budget, so the
    stream ends with a clear error naming the budget, and no resumed request is sent."""
    for gw in _gateway(nats_url, tmp_path, "--max-migration-seconds", "1"):
        mesh = await _mesh_for(gw, nats_url, instance="sched-slow")
        mesh.reply = lambda req: Admitted(
            rid=req.rid, instance_id="sched-next" if req.output_ids else "sched-slow", prompt_tokens=3
        )
        mesh.plan = lambda req: [_delta(req.rid, "sched-slow", 0, "partial")]  # then silence
        try:
            rest = await _rest_after_silencing(gw, mesh)
            assert rest[-1] == "[DONE]"
            error = rest[-2]["error"]
            assert error["type"] == "service_unavailable", error
            assert "sched-slow" in error["message"] and "past 1 s" in error["message"], error
            assert not any(r.output_ids for r in mesh.requests)
        finally:
            await mesh.stop()


async def test_a_stop_string_truncates_the_text_and_aborts_the_scheduler(gateway, mesh) -> None:
    mesh.plan = lambda req: [
        _delta(req.rid, mesh.instance, 0, "Hello"),
        _delta(req.rid, mesh.instance, 1, " wor"),
        _delta(req.rid, mesh.instance, 2, "ld! ST"),
        _delta(req.rid, mesh.instance, 3, "OP more"),
        _delta(req.rid, mesh.instance, 4, " never"),
    ]
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=20) as client,
        client.stream(
            "POST", "/v1/completions", json={"model": MODEL, "prompt": "x", "stream": True, "stop": ["STOP"]}
        ) as s,
    ):
        events = await _sse(s)
    texts = [e["choices"][0]["text"] for e in events if isinstance(e, dict)]
    assert "".join(texts) == "Hello world! " and not any("ST" in t for t in texts)
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    await wait_until_async(lambda: mesh.aborted(mesh.requests[-1].rid), "the stopped request is aborted")


async def test_n_fans_out_into_indexed_child_requests(gateway, mesh) -> None:
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, req.rid[-1], finished=True)]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        r = await client.post("/v1/chat/completions", json=_chat(n=2, seed=7, temperature=0.8))
    body = r.json()
    rids = sorted(req.rid for req in mesh.requests)
    assert rids[0].endswith("-0") and rids[1].endswith("-1") and rids[0][:-2] == rids[1][:-2]
    assert [c["message"]["content"] for c in body["choices"]] == ["0", "1"]
    assert sorted(req.sampling.seed for req in mesh.requests) == [7, 8]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


async def test_the_session_reaches_the_tokenizer_from_the_header_or_user(gateway, mesh) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        await client.post("/v1/chat/completions", json=_chat(user="alice"))
        await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": "hi", "user": "alice"},
            headers={"x-session-id": "s-1"},
        )
        await client.post("/v1/chat/completions", json=_chat())
    assert [req.session_id for req in mesh.requests] == ["alice", "s-1", None]


async def test_client_disconnect_mid_stream_aborts_the_request(gateway, mesh) -> None:
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "first")]  # and then it keeps "generating"
    async with (
        httpx.AsyncClient(base_url=gateway.url, timeout=20) as client,
        client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s,
    ):
        async for line in s.aiter_lines():
            if "first" in line:
                break
    rid = mesh.requests[-1].rid
    await wait_until_async(lambda: mesh.aborted(rid), "the disconnected request is aborted", timeout_s=5.0)


async def test_client_disconnect_while_waiting_non_streaming_aborts(gateway, mesh) -> None:
    mesh.plan = lambda req: []  # admitted, never answers
    async with httpx.AsyncClient(base_url=gateway.url, timeout=1.5) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
    rid = mesh.requests[-1].rid
    await wait_until_async(lambda: mesh.aborted(rid), "the disconnected request is aborted", timeout_s=5.0)


async def test_the_deadline_header_ends_a_silent_request_with_504(gateway, mesh) -> None:
    mesh.plan = lambda req: []
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        started = time.monotonic()
        r = await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"X-Request-Timeout": "1"}
        )
    assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
    assert time.monotonic() - started < 5


async def test_logprobs_are_passed_through_in_openai_shape(gateway, mesh) -> None:
    lp = [
        TokenLogprob(
            100,
            -0.5,
            ((100, -0.5),),
            token="hi",
            token_bytes=bytes([104, 105]),
            top_tokens=("hi",),
            top_bytes=(bytes([104, 105]),),
        )
    ]
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "hi", finished=True, logprobs=lp)]
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:
        chat = (await client.post("/v1/chat/completions", json=_chat(logprobs=True, top_logprobs=1))).json()
        cmpl = (
            await client.post("/v1/completions", json={"model": MODEL, "prompt": "x", "logprobs": 1})
        ).json()
    content = chat["choices"][0]["logprobs"]["content"]
    assert content[0]["token"] == "hi" and content[0]["top_logprobs"][0]["logprob"] == -0.5
    assert cmpl["choices"][0]["logprobs"]["token_logprobs"] == [-0.5]
    assert mesh.requests[-1].sampling.logprobs.top == 1


async def test_output_lost_across_a_nats_restart_ends_with_a_clear_error(gateway, nats_srv) -> None:
    mesh = await _mesh_for(gateway, nats_srv.url, instance="sched-restart")
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "before")]
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s,
        ):
            lines = s.aiter_lines()
            async for line in lines:
                if "before" in line:
                    break
            # The scheduler finishes the request while NATS is down: its last delta never reaches us.
            mesh.active.clear()
            started = time.monotonic()
            nats_srv.restart()  # from this thread: the server dies with the thread that started it
            rest = [x for x in [line async for line in lines] if x.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert "lost while NATS reconnected" in error["message"] and error["type"] == "service_unavailable"
        assert time.monotonic() - started < 20
    finally:
        await mesh.stop()


async def test_a_request_still_running_survives_a_nats_restart(gateway, nats_srv) -> None:
    mesh = await _mesh_for(gateway, nats_srv.url, instance="sched-survives")
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "before")]
    try:
        async with (
            httpx.AsyncClient(base_url=gateway.url, timeout=60) as client,
            client.stream("POST", "/v1/chat/completions", json=_chat(stream=True)) as s,
        ):
            lines = s.aiter_lines()
            async for line in lines:
                if "before" in line:
                    break
            asked = mesh.stats_answered
            nats_srv.restart()
            rid = mesh.requests[-1].rid
            await wait_until_async(
                lambda: mesh.stats_answered > asked, "the gateway audits its requests after the reconnect", 30
            )
            # Quiet window: a request the audit judged lost would be failed after the gateway's 1 s grace
            # (_AUDIT_GRACE_S); the final delta comes only after it, so only a kept request can still finish.
            await asyncio.sleep(1.5)
            final = _delta(rid, mesh.instance, 1, " after", finished=True)
            await mesh.nc.publish(gateway_subject(mesh.requests[-1].gateway_id), final.to_bytes())
            rest = [json.loads(x[6:]) for x in [line async for line in lines] if x.startswith("data: {")]
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in rest) == " after"
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
    finally:
        await mesh.stop()


async def test_no_scheduler_means_503_with_retry_after_and_not_ready(gateway) -> None:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=20) as client:

        async def not_ready() -> bool:
            return (await client.get("/ready")).status_code == 503

        # Earlier tests' fake schedulers expire from the registry.
        await wait_until_async(not_ready, "/ready says no scheduler is live", timeout_s=6.0, interval_s=0.1)
        r = await client.post("/v1/chat/completions", json=_chat())
        assert (await client.get("/health")).status_code == 200
    assert (
        r.status_code == 503
        and r.headers["retry-after"]
        and r.json()["error"]["type"] == "service_unavailable"
    )


@pytest.fixture(scope="module")
def guarded_gateway(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    tmp = tmp_path_factory.mktemp("guarded")
    keys = tmp / "keys"
    keys.write_text("# comment\nkey-one\nkey-two\n")
    yield from _gateway(
        nats_url,
        tmp,
        "--api-keys-file",
        str(keys),
        "--max-concurrent-per-key",
        "1",
        "--max-body-bytes",
        "4096",
    )


async def test_api_keys_body_limit_and_per_key_concurrency(guarded_gateway, nats_url) -> None:
    gw = guarded_gateway
    auth = {"Authorization": "Bearer key-one"}
    mesh = await _mesh_for(gw, nats_url, instance="sched-guarded", headers=auth)
    mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "slow")]  # streams stay open
    try:
        async with httpx.AsyncClient(base_url=gw.url, timeout=20) as client:
            assert (await client.post("/v1/chat/completions", json=_chat())).status_code == 401
            bad = await client.post(
                "/v1/chat/completions", json=_chat(), headers={"Authorization": "Bearer x"}
            )
            assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
            assert (await client.get("/health")).status_code == 200  # probes need no key
            big = await client.post(
                "/v1/completions", headers=auth, json={"model": MODEL, "prompt": "x" * 5000}
            )
            assert big.status_code == 413 and big.json()["error"]["code"] == "request_too_large"
            async with client.stream(
                "POST", "/v1/chat/completions", json=_chat(stream=True), headers=auth
            ) as s:
                lines = s.aiter_lines()  # held: a dropped iterator is finalized, which closes the stream
                async for line in lines:
                    if "slow" in line:
                        break
                second = await client.post("/v1/chat/completions", json=_chat(), headers=auth)
                assert second.status_code == 429 and second.headers["retry-after"]
                other = {"Authorization": "Bearer key-two"}
                mesh.plan = lambda req: [_delta(req.rid, mesh.instance, 0, "ok", finished=True)]
                assert (
                    await client.post("/v1/chat/completions", json=_chat(), headers=other)
                ).status_code == 200

            async def admitted() -> bool:
                return (
                    await client.post("/v1/chat/completions", json=_chat(), headers=auth)
                ).status_code == 200

            await wait_until_async(
                admitted, "the closed stream releases its slot", timeout_s=5.0, interval_s=0.05
            )
    finally:
        await mesh.stop()


def test_gateway_exits_cleanly_on_sigterm(nats_url: str, tmp_path: Path) -> None:
    gw = GatewayProcess(nats_url, tmp_path)
    gw.wait_healthy()
    wait_http(f"{gw.url}/metrics", 5)
    assert gw.stop() == 0, gw.log()


async def test_gateway_is_alive_before_nats_and_ready_after(tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "late-nats", port=free_port())
    gw = GatewayProcess(server.url, tmp_path)
    try:
        gw.wait_healthy()
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            assert (await client.get("/ready")).status_code == 503
            early = await client.post("/v1/chat/completions", json=_chat())
            assert early.status_code == 503 and "connecting to NATS" in early.json()["error"]["message"]
            server.start()

            async def models_served() -> bool:
                return (await client.get("/v1/models")).status_code == 200

            await wait_until_async(models_served, "the gateway connects to the late NATS", interval_s=0.1)
            assert (await client.get("/v1/models")).json() == {"object": "list", "data": []}
    finally:
        gw.stop()
        server.stop()
