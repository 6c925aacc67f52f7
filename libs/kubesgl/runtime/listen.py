"""Listening sockets a launcher binds and hands to its children, as systemd socket activation does.

Choosing a "free" port by binding and closing it, then passing its number on, leaves a window (the child's
imports: seconds on a busy box) in which any other process may take that port; the child then fails to bind
and the port answers for someone else. A socket bound and listening before the child starts has no window:
`kubesgl up` (and every test stack) starts each service this way, and its port is known before the child
runs. In a pod nothing changes: the services bind their configured ports themselves.
"""

from __future__ import annotations

import argparse
import socket

_BACKLOG = 2048  # uvicorn's default; the kernel caps it at net.core.somaxconn


def listen_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
    """A TCP socket listening on host:port (port 0: any free one), inheritable by a child (`pass_fds`).
    `reuse_port` sets SO_REUSEPORT, so more sockets of this user may listen on the same port and the kernel
    spreads new connections over them (a gateway's workers, services/gateway/workers.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn and asyncio servers do
        if reuse_port:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
        sock.listen(_BACKLOG)
    except BaseException:
        sock.close()
        raise
    return sock


def inherited_socket(fd: int) -> socket.socket:
    """The listening TCP socket a launcher passed as descriptor `fd`; ValueError if `fd` is not one."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise ValueError(f"descriptor {fd} is not an open socket: {e.strerror}") from None
    listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
    if (
        sock.type != socket.SOCK_STREAM
        or sock.family not in (socket.AF_INET, socket.AF_INET6)
        or not listening
    ):
        sock.detach()  # not ours to close
        raise ValueError(f"descriptor {fd} is not a listening TCP socket")
    sock.setblocking(False)
    return sock


def inherited_socket_arg(value: str) -> socket.socket:
    """argparse `type` of a descriptor flag (--fd, --admin-fd): the socket, or the flag's error (exit 2)."""
    if not value.isdigit():
        raise argparse.ArgumentTypeError(f"{value!r} is not a descriptor number")
    try:
        return inherited_socket(int(value))
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
