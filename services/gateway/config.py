"""The gateway's settings, from its command-line flags (and the environment for secrets' locations)."""

from __future__ import annotations

import argparse
import os
import re
import socket
import uuid
from dataclasses import dataclass

from kubesgl.runtime.listen import inherited_socket_arg
from kubesgl.runtime.nats_conn import add_nats_arguments


@dataclass(frozen=True)
class GatewayConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    sock: socket.socket | None = (
        None  # an inherited listening socket (--fd, runtime/listen.py), not host:port
    )
    nats_url: str | None = None
    gateway_id: str = ""
    request_timeout_s: float = 600.0
    inactivity_timeout_s: float = 300.0
    max_body_bytes: int = 1 << 20
    api_keys_file: str | None = None
    max_concurrent_per_key: int = 0
    tokenize_attempt_timeout_s: float = 5.0
    drain_timeout_s: float = 30.0
    log_level: str = "info"
    workers: int = 1  # gateway processes on this port (services/gateway/workers.py)
    max_migrations: int = 3  # per choice: re-admissions after its scheduler instance died (0 = none)
    max_migration_seconds: float = 30.0  # per choice: the pause its migrations may add to its stream


def default_gateway_id() -> str:
    # One NATS subject token per process: hostname (the pod name) plus a random suffix for restarts.
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:40] or "gw"
    return f"{host}-{uuid.uuid4().hex[:8]}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_nats_arguments(parser)
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port (API, /health, /ready, /metrics)")
    parser.add_argument(
        "--fd",
        dest="sock",
        type=inherited_socket_arg,
        default=None,
        help="serve on this inherited listening socket instead of binding --host/--port "
        "(how `kubesgl up` hands each gateway a port no other process can take meanwhile)",
    )
    parser.add_argument(
        "--gateway-id", default=None, help="NATS reply subject token (default: hostname-random)"
    )
    parser.add_argument(
        "--request-timeout",
        type=float,
        default=600.0,
        help="deadline per request in seconds; a client may lower it with the X-Request-Timeout header",
    )
    parser.add_argument(
        "--inactivity-timeout",
        type=float,
        default=300.0,
        help="fail a request after this many seconds without output from its scheduler",
    )
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    parser.add_argument(
        "--api-keys-file",
        default=os.environ.get("KUBESGL_API_KEYS_FILE"),
        help="file with one API key per line (env KUBESGL_API_KEYS_FILE); authentication is off without it",
    )
    parser.add_argument(
        "--max-concurrent-per-key",
        type=int,
        default=0,
        help="concurrent requests per API key before 429 (0 = unlimited; without API keys one shared limit)",
    )
    parser.add_argument(
        "--tokenize-attempt-timeout",
        type=float,
        default=5.0,
        help="seconds to wait for admission before retrying with the same request id",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM, seconds to let in-flight requests finish",
    )
    parser.add_argument(
        "--max-migrations",
        type=int,
        default=3,
        help="times one choice may move to another scheduler instance when its own dies mid-stream (0: it fails)",
    )
    parser.add_argument(
        "--max-migration-seconds",
        type=float,
        default=30.0,
        help="the pause one choice's migrations may add to its stream, summed (from its last delta before its "
        "instance was declared dead to its resumed admission); past it the stream fails",
    )
    parser.add_argument("--log-level", default="info")
    parser.add_argument(
        "--workers",
        type=_positive_int,
        default=1,
        help="gateway processes serving this port, each with its own NATS connection (SO_REUSEPORT spreads "
        "connections over them); one core each is what a busy worker uses",
    )


def _positive_int(value: str) -> int:
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number >= 1")
    return int(value)


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    return GatewayConfig(
        host=args.host,
        port=args.port,
        sock=args.sock,
        nats_url=args.nats_url,
        gateway_id=args.gateway_id or default_gateway_id(),
        request_timeout_s=args.request_timeout,
        inactivity_timeout_s=args.inactivity_timeout,
        max_body_bytes=args.max_body_bytes,
        api_keys_file=args.api_keys_file,
        max_concurrent_per_key=args.max_concurrent_per_key,
        tokenize_attempt_timeout_s=args.tokenize_attempt_timeout,
        drain_timeout_s=args.drain_timeout,
        log_level=args.log_level,
        workers=args.workers,
        max_migrations=args.max_migrations,
        max_migration_seconds=args.max_migration_seconds,
    )
