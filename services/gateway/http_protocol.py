"""The gateway's HTTP protocol: uvicorn's own, plus the time each connection's first request reached this
host, so the gateway's TTFT also counts what a busy event loop makes a new connection wait before ASGI entry
(its accept, its first read, the HTTP parse, the task's first turn).

Where Linux tells it (TCP_INFO's `tcpi_last_data_recv`, read at the first bytes the loop takes from the
socket), that time is when the kernel received the request's bytes, accept queue included; elsewhere it is the
connection's accept. Only the first request of a connection is timed so: a keep-alive follow-up's clock starts
at its own ASGI arrival, as the connection's start says nothing of when the follow-up was sent."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

from kubesgl.services.gateway.access_log import FIRST_REQUEST_ARRIVAL, Arrival
from uvicorn.protocols.http.auto import AutoHTTPProtocol

_TCP_INFO_LEN = 104
# struct tcp_info: 8 bytes of u8 fields, then u32s, of which tcpi_last_data_recv is the 12th.
_LAST_DATA_RECV_OFFSET = 52


class FirstRequestArrival:
    """One connection's first request arrival, taken once (by AccessLog, at the request's ASGI entry)."""

    def __init__(self, sock: Any) -> None:
        self._sock = sock
        self._accepted = time.perf_counter()
        self._arrival: Arrival | None = None
        self._taken = False

    def on_data(self) -> None:
        """The loop read bytes from the connection: the first time, fixes when the request arrived."""
        if self._arrival is not None or self._taken:
            return
        now_perf, now_ns = time.perf_counter(), time.time_ns()
        age = _kernel_receipt_age(self._sock)
        if age is None:
            age = now_perf - self._accepted
        self._arrival = Arrival(now_perf - age, now_ns - int(age * 1e9))

    def take(self) -> Arrival | None:
        """The first request's arrival; None for every later request on the connection."""
        if self._taken:
            return None
        self._taken = True
        return self._arrival


def _kernel_receipt_age(sock: Any) -> float | None:
    """Seconds since the kernel received the connection's last data segment (ms resolution), or None where
    TCP_INFO cannot be read (not Linux, not TCP)."""
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO_LEN)
    except OSError:
        return None
    if len(info) < _LAST_DATA_RECV_OFFSET + 4:
        return None
    return struct.unpack_from("I", info, _LAST_DATA_RECV_OFFSET)[0] / 1000


class TimedHttpProtocol(AutoHTTPProtocol):  # type: ignore[misc,valid-type]  # a class chosen at import
    """uvicorn's HTTP/1.1 protocol (httptools where installed, else h11) handing every request's scope the
    connection's FirstRequestArrival (through the per-request copy uvicorn makes of `app_state`)."""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._first_request = FirstRequestArrival(transport.get_extra_info("socket"))
        self.app_state = {**self.app_state, FIRST_REQUEST_ARRIVAL: self._first_request}
        super().connection_made(transport)

    def data_received(self, data: bytes) -> None:
        self._first_request.on_data()
        super().data_received(data)
