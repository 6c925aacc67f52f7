"""Sockets the launcher binds and its children serve on: bound before the child runs, refused when not a
listening TCP socket, and the services' --admin-fd/--fd flags say so plainly."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest
from kubesgl.runtime.listen import inherited_socket, listen_socket


def test_a_listening_socket_is_taken_at_once_and_accepts_before_anyone_serves() -> None:
    sock = listen_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.socket() as other, pytest.raises(OSError):
            other.bind(("127.0.0.1", port))
        # A client's connect completes (kernel backlog) before any process accepts: a probe waits, not refused.
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
        again = inherited_socket(sock.fileno())
        assert again.getsockname() == sock.getsockname()
        again.detach()
    finally:
        sock.close()


def test_a_descriptor_that_is_no_listening_tcp_socket_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match="is not an open socket"):
        inherited_socket(987)
    with socket.socket() as unbound, pytest.raises(ValueError, match="not a listening TCP socket"):
        inherited_socket(unbound.fileno())
    with (
        socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as udp,
        pytest.raises(ValueError, match="not a listening"),
    ):
        udp.bind(("127.0.0.1", 0))
        inherited_socket(udp.fileno())
    f = (tmp_path / "plain").open("w")
    try:
        with pytest.raises(ValueError, match="is not an open socket"):
            inherited_socket(f.fileno())
    finally:
        f.close()


@pytest.mark.parametrize(
    ("service", "flag", "model"),
    [("detokenizer", "--admin-fd", True), ("gateway", "--fd", False)],
)
def test_a_service_given_a_bad_descriptor_exits_2_saying_why(
    service: str, flag: str, model: bool, demo_model_dir: str
) -> None:
    args = [sys.executable, "-m", "kubesgl.cli", service, flag, "987", "--nats-url", "nats://127.0.0.1:1"]
    args += ["--model", demo_model_dir] if model else []
    done = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stdout + done.stderr
    assert f"{flag}: descriptor 987 is not an open socket" in done.stderr
