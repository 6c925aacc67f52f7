"""The bus services' admin endpoint: liveness, readiness as the service reports it, Prometheus text."""

from __future__ import annotations

import asyncio

import httpx
from kubesgl.runtime.admin_http import AdminServer
from kubesgl.runtime.telemetry.metrics import DetokenizerMetrics, new_registry


async def test_health_ready_and_metrics() -> None:
    ready = False
    registry = new_registry()
    DetokenizerMetrics(registry).on_decoded(3)
    admin = AdminServer("127.0.0.1", 0, lambda: ready, registry)
    port = await admin.start()
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
            assert (await http.get("/health")).status_code == 200
            assert (await http.get("/ready")).status_code == 503
            ready = True
            assert (await http.get("/ready?verbose=1")).status_code == 200
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
            assert "kubesgl_detokenizer_tokens_total 3.0" in metrics.text
            assert (await http.get("/nope")).status_code == 404
            assert (await http.post("/ready")).status_code == 405
    finally:
        await admin.stop()


async def test_garbage_and_silent_clients_do_not_hang_it() -> None:
    admin = AdminServer("127.0.0.1", 0, lambda: True, new_registry())
    port = await admin.start()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"\x16\x03\x01garbage\r\n\r\n")
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 5)
        assert status_line.startswith(b"HTTP/1.1 400")
        writer.close()
        silent_reader, silent = await asyncio.open_connection("127.0.0.1", port)  # sends nothing
        async with httpx.AsyncClient(timeout=5) as http:
            assert (await http.get(f"http://127.0.0.1:{port}/health")).status_code == 200
        silent.close()
    finally:
        await admin.stop()
