"""`kubesgl gateway --workers N`: N gateway processes on one port, over a real nats-server, with the tokenizer,
scheduler and detokenizer replaced by test_gateway_transport's FakeMeshForGatewayTest (these tests are about the
workers: connections spread over them, one /metrics for the pod, readiness, drain on SIGTERM, a dead worker)."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import psutil
import pytest
from kubesgl.runtime.nats_server import NatsServer
from support.gateway_helpers import GatewayProcess
from support.waiting import wait_until_async
from test_gateway_transport import MODEL, FakeMeshForGatewayTest, _chat, _delta, _sse

WORKERS = 2
STREAMS = 16  # with one connection each, the chance that all land on one of 2 workers is 2 * 2**-16


@pytest.fixture(scope="module")
def nats_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = NatsServer(tmp_path_factory.mktemp("nats"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def _workers(nats_url: str, tmp: Path) -> GatewayProcess:
    gw = GatewayProcess(nats_url, tmp, "--workers", str(WORKERS), "--drain-timeout", "20")
    gw.wait_healthy()
    return gw


async def _mesh(gw: GatewayProcess, nats_url: str) -> FakeMeshForGatewayTest:
    """The fake mesh, once /ready says every worker connected and heard its scheduler."""
    mesh = FakeMeshForGatewayTest(await nats.connect(nats_url))
    async with httpx.AsyncClient(base_url=gw.url, timeout=5) as client:
        assert (await client.get("/ready")).status_code == 503  # no scheduler yet
        await mesh.start()

        async def ready() -> bool:
            return (await client.get("/ready", headers={"Connection": "close"})).status_code == 200

        await wait_until_async(ready, "every worker heard the fake scheduler", interval_s=0.1)
    return mesh


async def _stream(url: str, body: dict) -> list[dict | str]:
    # A client of its own per stream: a new connection, which the kernel may give to either worker.
    async with (
        httpx.AsyncClient(base_url=url, timeout=30) as client,
        client.stream("POST", "/v1/chat/completions", json=body) as s,
    ):
        assert s.status_code == 200
        return await _sse(s)


def _text(events: list[dict | str]) -> str:
    chunks = [e for e in events if isinstance(e, dict)]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


def _samples(metrics_text: str, name: str) -> list[str]:
    return [line for line in metrics_text.splitlines() if line.startswith(name)]


async def test_workers_share_the_port_and_one_metrics_endpoint_counts_them_all(nats_url, tmp_path) -> None:
    gw = _workers(nats_url, tmp_path)
    try:
        mesh = await _mesh(gw, nats_url)
        mesh.plan = lambda req: [
            _delta(req.rid, mesh.instance, i, f"t{i} ", finished=i == 3) for i in range(4)
        ]
        async with httpx.AsyncClient(base_url=gw.url, timeout=10) as client:
            results = await asyncio.gather(*(_stream(gw.url, _chat(stream=True)) for _ in range(STREAMS)))
            assert all(r[-1] == "[DONE]" and _text(r) == "t0 t1 t2 t3 " for r in results)
            # Every worker has its own NATS reply subject: the admissions name both.
            assert len({req.gateway_id for req in mesh.requests[-STREAMS:]}) == WORKERS
            for _ in range(4):  # whichever worker answers the scrape reports the pod's sum
                scrape = await client.get("/metrics", headers={"Connection": "close"})
                ok = _samples(scrape.text, "kubesgl_gateway_requests_total{")
                counted = sum(float(s.rsplit(" ", 1)[1]) for s in ok if 'status="200"' in s)
                assert counted == STREAMS, ok
                tokens = _samples(scrape.text, "kubesgl_gateway_completion_tokens_total{")
                assert [float(s.rsplit(" ", 1)[1]) for s in tokens] == [4.0 * STREAMS]
                in_flight = _samples(scrape.text, f'kubesgl_gateway_requests_in_flight{{model="{MODEL}"}}')
                assert [float(s.rsplit(" ", 1)[1]) for s in in_flight] == [0.0]
                cpu = _samples(scrape.text, "process_cpu_seconds_total{")
                assert sorted(s.split('worker="')[1].split('"')[0] for s in cpu) == ["0", "1"]
        await mesh.stop()
    finally:
        assert gw.stop() == 0, gw.log()


async def test_sigterm_lets_every_worker_finish_its_streams(nats_url, tmp_path) -> None:
    gw = _workers(nats_url, tmp_path)
    mesh = await _mesh(gw, nats_url)
    deltas = 60  # 10 ms apart (the fake's pace): the SIGTERM below comes while every stream still runs
    mesh.plan = lambda req: [
        _delta(req.rid, mesh.instance, i, "x", finished=i == deltas - 1) for i in range(deltas)
    ]
    try:
        streams = [asyncio.create_task(_stream(gw.url, _chat(stream=True))) for _ in range(STREAMS)]
        while len(mesh.active) < STREAMS:
            await asyncio.sleep(0.02)
        gw.proc.send_signal(signal.SIGTERM)
        results = await asyncio.gather(*streams)
        assert all(r[-1] == "[DONE]" and _text(r) == "x" * deltas for r in results)
        assert len({req.gateway_id for req in mesh.requests[-STREAMS:]}) == WORKERS
        assert await asyncio.to_thread(gw.proc.wait, 20) == 0, gw.log()
    finally:
        await mesh.stop()
        gw.stop()


def test_a_worker_that_dies_stops_the_gateway_with_an_error(nats_url, tmp_path) -> None:
    gw = _workers(nats_url, tmp_path)
    try:
        workers = psutil.Process(gw.proc.pid).children()
        spawned = [p for p in workers if "--multiprocessing-fork" in p.cmdline()]
        assert len(spawned) == WORKERS
        spawned[0].kill()
        assert gw.proc.wait(20) == 1, gw.log()
        assert "exited with -9" in gw.log()
        psutil.wait_procs(spawned, timeout=20)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in spawned)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the gateway kept running without a worker:\n{gw.log()}")
    finally:
        gw.stop()
