"""`kubesgl up`: the whole mesh on one machine, exactly as it runs in pods: an embedded nats-server, then
every service as its own OS process (replica counts as flags), ready-checked, shut down cleanly on Ctrl-C.

`Stack` is also what the tests launch (tests/conftest.py), so `make up` and CI exercise the same wiring.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

from kubesgl.runtime.listen import listen_socket
from kubesgl.runtime.nats_server import NatsServer
from kubesgl.runtime.process import parent_death_signal, terminate

KINDS = ("scheduler", "detokenizer", "tokenizer", "gateway")  # start order: engines load meanwhile
# Stop order: stop taking traffic first; detokenizers last so draining schedulers can still flush output.
STOP_ORDER = ("gateway", "tokenizer", "scheduler", "detokenizer")
DEMO = "demo"
# The demo's random weights never pick EOS: without a cap, a request without max_tokens runs to the context end.
DEMO_DEFAULT_MAX_TOKENS = 256
NATS_GOMAXPROCS = 2  # the embedded nats-server's (StackConfig.nats_gomaxprocs)


@dataclass(frozen=True)
class StackConfig:
    model_path: str
    served_model_name: str
    schedulers: int = 1
    # Prefill/decode disaggregation: schedulers started with --disaggregation-mode prefill / decode, after the
    # `schedulers` that serve whole requests.
    prefill_schedulers: int = 0
    decode_schedulers: int = 0
    detokenizers: int = 1
    tokenizers: int = 1
    gateways: int = 1
    gateway_workers: int = 1  # processes per gateway, on its one port (`kubesgl gateway --workers`)
    host: str = "127.0.0.1"
    port: int = 8000  # gateway i listens on port + i; 0 = free ports
    # The other services' admin ports (/health /ready /metrics) from here up, in start order; 0 = free ports.
    base_port: int = 0
    nats_port: int = 0  # 0 = a free port
    # The embedded nats-server's GOMAXPROCS (0: Go's default, one per core). Its work here is a few thousand small
    # messages a second; with a thread per core on a many-core host, Go's idle threads spin and wake for each.
    nats_gomaxprocs: int = NATS_GOMAXPROCS
    scheduler_args: tuple[str, ...] = ()
    tokenizer_args: tuple[str, ...] = ()
    gateway_args: tuple[str, ...] = ()
    log_level: str = "info"
    log_to_files: bool = True  # else children share the launcher's terminal
    env: dict[str, str] = field(default_factory=dict)

    @property
    def all_schedulers(self) -> int:
        return self.schedulers + self.prefill_schedulers + self.decode_schedulers


_TAIL_LINES = 30  # of a child's output kept in memory, to show why it died


class PortInUseError(RuntimeError):
    """A port the stack is configured to listen on is taken (often: another `kubesgl up` is running)."""


@dataclass
class ServiceProcess:
    name: str  # e.g. "scheduler-0"
    kind: str
    proc: subprocess.Popen[bytes]
    ready_url: str
    log_path: Path | None
    instance_id: str | None = None  # schedulers only
    extra_args: tuple[str, ...] = ()  # flags it was spawned with beyond the stack's (a restart keeps them)
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))  # output, when not to a file
    _pump: threading.Thread | None = None

    @property
    def metrics_url(self) -> str:
        return self.ready_url.removesuffix("/ready") + "/metrics"

    def log_tail(self, lines: int = _TAIL_LINES) -> str:
        if self.log_path is None:
            if self._pump is not None:
                self._pump.join(2.0)  # the child has exited: let its last lines arrive
            return "\n".join(list(self.tail)[-lines:])
        if not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def relay_output(self, width: int) -> None:
        """Copies the child's output to our stdout, each line prefixed with its name, keeping the last lines."""
        assert self.proc.stdout is not None
        prefix = f"{self.name:<{width}} | "

        def pump() -> None:
            assert self.proc.stdout is not None
            for raw in self.proc.stdout:
                line = raw.decode(errors="replace").rstrip("\n")
                self.tail.append(line)
                with contextlib.suppress(OSError, ValueError):  # our stdout closed: keep draining the pipe
                    sys.stdout.write(prefix + line + "\n")
                    sys.stdout.flush()

        self._pump = threading.Thread(target=pump, name=f"relay-{self.name}", daemon=True)
        self._pump.start()


class Stack:
    """An embedded nats-server plus the configured replicas of every service, each its own process."""

    def __init__(self, config: StackConfig, workdir: str | Path) -> None:
        self.config = config
        self.workdir = Path(workdir)
        self.nats = NatsServer(
            self.workdir / "nats", port=config.nats_port, gomaxprocs=config.nats_gomaxprocs or None
        )
        self.services: dict[str, ServiceProcess] = {}
        self._counts: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._ports = planned_ports(config)
        # A replica added later (tests scale up mid-run) takes the next admin port after the planned ones.
        admin_planned = [n for n in self._ports if not n.startswith("gateway")]
        self._next_admin_port = config.base_port + len(admin_planned)

    @property
    def nats_url(self) -> str:
        return self.nats.url

    @property
    def gateway_urls(self) -> list[str]:
        return [s.ready_url.removesuffix("/ready") for s in self.services.values() if s.kind == "gateway"]

    def check_ports(self) -> None:
        """Raises PortInUseError naming the first configured port that is taken, and the flag that moves it."""
        for name, port in self._ports.items():
            gateway = name.startswith("gateway")
            host = self.config.host if gateway else "127.0.0.1"
            if port_free(host, port):
                continue
            flag = "--port (the gateways)" if gateway else "--base-port (the other services' admin ports)"
            url = f"http://{_connect_host(host)}:{port}/metrics"
            whose = (
                "another kubesgl stack is serving there (`make up` / `kubesgl up` already running?)"
                if _is_kubesgl(url)
                else "another program listens there"
            )
            c = self.config
            moved = [f"--port {c.port + 10}"] * bool(c.port) + [f"--base-port {c.base_port + 10}"] * bool(
                c.base_port
            )
            raise PortInUseError(
                f"port {port} for {name} is already in use: {whose}. Stop it, or move this stack with "
                f'{flag}, e.g. `make up ARGS="{" ".join(moved)}"`'
            )

    def start(self) -> None:
        self.nats.start()
        c = self.config
        for kind, n in zip(KINDS, (c.schedulers, c.detokenizers, c.tokenizers, c.gateways), strict=True):
            for _ in range(n):
                self.spawn(kind)
            if kind == "scheduler":
                for role, m in (("prefill", c.prefill_schedulers), ("decode", c.decode_schedulers)):
                    for _ in range(m):
                        self.spawn(kind, ("--disaggregation-mode", role))

    def _threads_env(self, kind: str) -> dict[str, str]:
        """CPU schedulers on one host share its cores: each torch pool sized to its share, not to all of them
        (oversubscribed pools made a 2-scheduler run ~10x slower). An explicit OMP_NUM_THREADS wins."""
        if kind != "scheduler" or "OMP_NUM_THREADS" in os.environ or "OMP_NUM_THREADS" in self.config.env:
            return {}
        return {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // max(self.config.all_schedulers, 1)))}

    def spawn(self, kind: str, extra_args: tuple[str, ...] = ()) -> ServiceProcess:
        """Starts one more replica of `kind` (also used by tests to scale up mid-run)."""
        index = self._counts[kind]
        self._counts[kind] += 1
        return self._start(kind, index, extra_args)

    def restart(self, name: str) -> ServiceProcess:
        """Starts the exited service `name` again, as a pod's container restarts: same name, ports, flags and
        (a scheduler) instance id."""
        old = self.services[name]
        assert old.proc.poll() is not None, f"{name} is still running"
        return self._start(old.kind, int(name.rsplit("-", 1)[1]), old.extra_args)

    def _start(self, kind: str, index: int, extra_args: tuple[str, ...]) -> ServiceProcess:
        name = f"{kind}-{index}"
        c = self.config
        args = [
            sys.executable,
            "-m",
            "kubesgl.cli",
            kind,
            "--nats-url",
            self.nats_url,
            "--log-level",
            c.log_level,
        ]
        instance_id = f"{name}-{os.getpid()}" if kind == "scheduler" else None
        # Bound and listening here, before the child starts: no other process can take the port meanwhile.
        host = c.host if kind == "gateway" else "127.0.0.1"
        planned = (c.port + index if c.port else 0) if kind == "gateway" else self._admin_port(name)
        # A gateway's workers each listen on its port too (SO_REUSEPORT): the socket handed over must allow it.
        workers = c.gateway_workers if kind == "gateway" else 1
        sock = self._listen(name, host, planned, reuse_port=workers > 1)
        try:
            port, fd = sock.getsockname()[1], sock.fileno()
            if kind == "gateway":
                args += ["--host", c.host, "--port", str(port), "--fd", str(fd), "--workers", str(workers)]
                args += c.gateway_args
                ready_url = f"http://{_connect_host(c.host)}:{port}/ready"
            else:
                args += ["--model", c.model_path, "--admin-host", host, "--admin-port", str(port)]
                args += ["--admin-fd", str(fd)]
                if kind in ("scheduler", "tokenizer"):
                    args += ["--served-model-name", c.served_model_name]
                if kind == "scheduler":
                    args += ["--instance-id", str(instance_id), *c.scheduler_args]
                if kind == "tokenizer":
                    args += list(c.tokenizer_args)
                ready_url = f"http://{host}:{port}/ready"
            log_path = self.workdir / f"{name}.log" if c.log_to_files else None
            # To a file, or through a pipe we relay to the terminal (so a child that dies shows us why).
            out = open(log_path, "ab") if log_path else subprocess.PIPE  # noqa: SIM115 - the child owns it
            try:
                proc = subprocess.Popen(
                    [*args, *extra_args],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, **self._threads_env(kind), **c.env},
                    # Own session: a terminal's Ctrl-C reaches only the launcher, which stops children in order.
                    start_new_session=True,
                    preexec_fn=parent_death_signal,
                    pass_fds=(fd,),
                )
            finally:
                if log_path:
                    out.close()
        finally:
            sock.close()  # the child holds it now: once it exits, the port refuses connections
        svc = ServiceProcess(name, kind, proc, ready_url, log_path, instance_id, extra_args)
        if log_path is None:
            svc.relay_output(width=max(len(n) for n in [*self._ports, name]))
        self.services[name] = svc
        return svc

    def _admin_port(self, name: str) -> int:
        """The planned port of a configured replica; past those (a replica added later), the next one up."""
        if not self.config.base_port:
            return 0  # any free port, chosen when spawn binds it
        if name in self._ports:
            return self._ports[name]
        port, self._next_admin_port = self._next_admin_port, self._next_admin_port + 1
        return port

    @staticmethod
    def _listen(name: str, host: str, port: int, reuse_port: bool = False) -> socket.socket:
        try:
            return listen_socket(host, port, reuse_port)
        except OSError as e:
            raise PortInUseError(f"{name} cannot listen on {host}:{port}: {e.strerror}") from e

    def wait_ready(self, timeout_s: float, names: list[str] | None = None) -> None:
        """Blocks until every (named) service answers /ready 200; raises if one exits or time runs out."""
        pending = set(names or self.services)
        end = time.monotonic() + timeout_s
        while pending:
            for name in sorted(pending):
                svc = self.services[name]
                if svc.proc.poll() is not None:
                    tail = svc.log_tail() or "(it printed nothing)"
                    raise RuntimeError(f"{name} exited with {svc.proc.returncode} while starting:\n{tail}")
                if http_ok(svc.ready_url):
                    pending.discard(name)
            if pending and time.monotonic() > end:
                raise TimeoutError(f"not ready after {timeout_s:.0f} s: {', '.join(sorted(pending))}")
            if pending:
                time.sleep(0.1)

    def dead(self) -> list[ServiceProcess]:
        return [s for s in self.services.values() if s.proc.poll() is not None]

    def kill(self) -> None:
        """SIGKILL every service and nats-server now (a second Ctrl-C)."""
        procs = [s.proc for s in self.services.values()] + ([self.nats.proc] if self.nats.proc else [])
        for proc in procs:
            if proc.poll() is None:
                proc.kill()

    def stop(self, timeout_s: float = 40.0) -> None:
        """Stops services group by group (SIGTERM, wait, SIGKILL stragglers), then nats-server.
        `timeout_s` per group exceeds the services' default drain grace (30 s)."""
        for kind in STOP_ORDER:
            terminate([s.proc for s in self.services.values() if s.kind == kind], timeout_s)
        self.nats.stop()


def planned_ports(c: StackConfig) -> dict[str, int]:
    """Every fixed port of the configured replicas, by service name: gateway i at `port + i`, the others'
    admin ports from `base_port` up in start order (schedulers, detokenizers, tokenizers). Free ports
    (0) are not planned."""
    ports: dict[str, int] = {}
    if c.port:
        ports |= {f"gateway-{i}": c.port + i for i in range(c.gateways)}
    if c.base_port:
        counts = {"scheduler": c.all_schedulers, "detokenizer": c.detokenizers, "tokenizer": c.tokenizers}
        names = [f"{kind}-{i}" for kind in KINDS if kind != "gateway" for i in range(counts[kind])]
        ports |= {name: c.base_port + k for k, name in enumerate(names)}
    taken: dict[int, str] = {}
    for name, port in ports.items():
        if port in taken:
            raise ValueError(
                f"{name} and {taken[port]} would both listen on port {port}: --port {c.port} (gateway i at "
                f"port + i) and --base-port {c.base_port} (the other services from there up) overlap"
            )
        taken[port] = name
    return ports


def port_free(host: str, port: int) -> bool:
    """Whether a server could listen on host:port now (with SO_REUSEADDR, as uvicorn and our admin do)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _is_kubesgl(metrics_url: str) -> bool:
    try:
        with urllib.request.urlopen(metrics_url, timeout=2.0) as r:
            return b"kubesgl_" in r.read(1 << 20)
    except (urllib.error.URLError, OSError, ValueError):
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_ok(url: str, timeout_s: float = 1.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def resolve_model(model: str, served_model_name: str | None) -> tuple[str, str]:
    """(model dir, served name); `demo` builds (once, cached) the tiny random Qwen3 with the real tokenizer."""
    if model == DEMO:
        from kubesgl.models.random_init import resolve_demo

        return resolve_demo(model), served_model_name or DEMO
    if not Path(model, "config.json").is_file():
        raise SystemExit(f"kubesgl up: {model} is not a model directory (no config.json)")
    return model, served_model_name or os.path.basename(os.path.normpath(model))


class MakeParent:
    """Under `make up`: notices a signal sent to make itself. GNU make hands only SIGTERM on to its recipe;
    on SIGINT (`kill -INT <make>`) it waits for the recipe to end, so `kubesgl up` would never hear of it.
    make's handler for a fatal signal first resets that signal to its default, which /proc shows: the
    signal leaves the parent's caught set (SigCgt). Linux only; elsewhere, or without make, it never fires."""

    _WATCHED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self._ppid = os.getppid()
        caught = _caught_signals(self._ppid) if "MAKELEVEL" in os.environ else None
        self._watched = {s for s in self._WATCHED if caught is not None and s in caught}

    def signalled(self) -> bool:
        if not self._watched or os.getppid() != self._ppid:
            return False
        caught = _caught_signals(self._ppid)
        return caught is not None and not self._watched <= caught


def _caught_signals(pid: int) -> set[int] | None:
    """The signals process `pid` has a handler for (its /proc status SigCgt mask), or None when unreadable."""
    try:
        with open(f"/proc/{pid}/status") as f:
            mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    except (OSError, StopIteration, ValueError):
        return None
    return {n for n in range(1, 65) if mask >> (n - 1) & 1}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", default=DEMO, help="HF model dir, or `demo` (tiny random Qwen3, built once)"
    )
    parser.add_argument("--served-model-name", default=None, help="model id clients send")
    parser.add_argument("--host", default="127.0.0.1", help="gateway address")
    parser.add_argument("--port", type=int, default=8000, help="gateway port (gateway i gets port + i)")
    parser.add_argument(
        "--base-port",
        type=int,
        default=8100,
        help="first admin port (/health /ready /metrics) of the other services, assigned upwards in start "
        "order: schedulers, detokenizers, tokenizers (0 = free ports)",
    )
    parser.add_argument("--nats-port", type=int, default=0, help="embedded nats-server port (0 = free)")
    parser.add_argument(
        "--nats-gomaxprocs",
        type=int,
        default=NATS_GOMAXPROCS,
        help="GOMAXPROCS of the embedded nats-server (0: Go's default, one per core; a GOMAXPROCS in the "
        "environment wins)",
    )
    parser.add_argument("--gateways", type=int, default=1)
    parser.add_argument(
        "--gateway-workers", type=int, default=1, help="worker processes per gateway, on its one port"
    )
    parser.add_argument("--tokenizers", type=int, default=1)
    parser.add_argument("--detokenizers", type=int, default=1)
    parser.add_argument(
        "--schedulers",
        type=int,
        default=None,
        help="schedulers serving whole requests (default 1; 0 with --prefill/--decode)",
    )
    parser.add_argument("--prefill", type=int, default=0, help="prefill-role schedulers (disaggregation)")
    parser.add_argument("--decode", type=int, default=0, help="decode-role schedulers (disaggregation)")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per scheduler")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--scheduler-args", default="", help="extra scheduler flags, e.g. '--page-size 16'")
    parser.add_argument(
        "--tokenizer-args", default="", help="extra tokenizer flags, e.g. '--session-affinity'"
    )
    parser.add_argument("--gateway-args", default="", help="extra gateway flags")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for /ready")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def main(args: argparse.Namespace) -> int:
    model_path, name = resolve_model(args.model, args.served_model_name)
    scheduler_args = shlex.split(args.scheduler_args)
    demo_cap = args.model == DEMO and "--default-max-tokens" not in scheduler_args
    if args.model == DEMO:
        # The demo's random weights never pick EOS nor close a JSON string or number: a default cap, and bounded
        # grammars so structured outputs finish (each unless the user's --scheduler-args set it).
        defaults = {"--default-max-tokens": [str(DEMO_DEFAULT_MAX_TOKENS)], "--bound-json-values": []}
        for flag, value in defaults.items():
            if flag not in scheduler_args:
                scheduler_args = [flag, *value, *scheduler_args]
    config = StackConfig(
        model_path=model_path,
        served_model_name=name,
        schedulers=args.schedulers if args.schedulers is not None else int(not (args.prefill or args.decode)),
        prefill_schedulers=args.prefill,
        decode_schedulers=args.decode,
        detokenizers=args.detokenizers,
        tokenizers=args.tokenizers,
        gateways=args.gateways,
        gateway_workers=args.gateway_workers,
        host=args.host,
        port=args.port,
        base_port=args.base_port,
        nats_port=args.nats_port,
        nats_gomaxprocs=args.nats_gomaxprocs,
        scheduler_args=("--tp", str(args.tp), "--device", args.device, *scheduler_args),
        tokenizer_args=tuple(shlex.split(args.tokenizer_args)),
        gateway_args=tuple(shlex.split(args.gateway_args)),
        log_level=args.log_level,
        log_to_files=False,
    )
    try:
        stack = Stack(config, Path(tempfile.mkdtemp(prefix="kubesgl-up-")))
        stack.check_ports()
    except (ValueError, PortInUseError) as e:
        print(f"kubesgl: {e}", file=sys.stderr, flush=True)
        return 2
    stopping: list[int] = []

    def on_signal(signum: int, _frame: FrameType | None) -> None:
        stopping.append(signum)
        if len(stopping) == 2:  # impatient: a graceful stop may wait out drain grace periods
            print("kubesgl: second interrupt: killing every service", file=sys.stderr, flush=True)
            stack.kill()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    make = MakeParent()
    code = 0
    try:
        try:
            stack.start()
        except PortInUseError as e:  # taken since check_ports looked
            print(f"kubesgl: {e}", file=sys.stderr, flush=True)
            return 2
        print(f"kubesgl: starting {_summary(config)} (model {model_path})", flush=True)
        if demo_cap:
            print(
                f"kubesgl: a request without max_tokens gets at most {DEMO_DEFAULT_MAX_TOKENS} tokens "
                "(the demo model never stops by itself; --scheduler-args '--default-max-tokens N' to change)",
                flush=True,
            )
        code = _wait_ready(stack, args.ready_timeout, stopping, make)
        if code == 0 and not stopping:
            print(_serving_banner(stack, name), flush=True)
            code = _supervise(stack, stopping, make)
    finally:
        print("kubesgl: shutting down", flush=True)
        stack.stop()
        shutil.rmtree(stack.workdir, ignore_errors=True)
        print("kubesgl: stopped", flush=True)
    return code


def _serving_banner(stack: Stack, model: str) -> str:
    """What a user needs once the stack is up: where to send requests, every service's metrics, a request."""
    urls = ", ".join(f"{u}/v1" for u in stack.gateway_urls)
    where = f"at {urls} (NATS {stack.nats_url}" if urls else f"on NATS {stack.nats_url} (no gateway"
    lines = [f"kubesgl: serving `{model}` {where}; Ctrl-C to stop, twice to kill)"]
    width = max(len(n) for n in stack.services)
    by_kind = sorted(stack.services.values(), key=lambda s: s.kind != "gateway")  # gateways first
    lines += [f"  {s.name:<{width}}  {s.metrics_url}" for s in by_kind]
    if urls:
        body = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 32}
        lines.append(
            f"  try: curl {stack.gateway_urls[0]}/v1/chat/completions "
            f"-H 'content-type: application/json' -d '{json.dumps(body)}'"
        )
    lines.append("  logs: an access line per request; while busy, a stats line per scheduler")
    return "\n".join(lines)


def _summary(c: StackConfig) -> str:
    counts = (c.gateways, c.tokenizers, c.all_schedulers, c.detokenizers)
    return ", ".join(f"{n} {k}(s)" for n, k in zip(counts, STOP_ORDER, strict=True))


def _stopping(stopping: list[int], make: MakeParent) -> bool:
    """Whether a stop was asked for: a signal to us, or one to the make that runs us (taken as Ctrl-C)."""
    if not stopping and make.signalled():
        print("kubesgl: make was signalled: stopping", file=sys.stderr, flush=True)
        stopping.append(signal.SIGINT)
    return bool(stopping)


def _wait_ready(stack: Stack, timeout_s: float, stopping: list[int], make: MakeParent) -> int:
    end = time.monotonic() + timeout_s
    while not _stopping(stopping, make):
        try:
            stack.wait_ready(min(1.0, max(0.0, end - time.monotonic())))
            return 0
        except TimeoutError:
            if time.monotonic() > end:
                print(f"kubesgl: services not ready within {timeout_s:.0f} s", file=sys.stderr)
                return 1
        except RuntimeError as e:
            if stopping:  # killed on purpose by a second Ctrl-C
                return 0
            print(f"kubesgl: {e}", file=sys.stderr)
            return 1
    return 0


def _supervise(stack: Stack, stopping: list[int], make: MakeParent) -> int:
    """Waits for Ctrl-C/SIGTERM (to us, or to the make that runs us). A service that dies on its own is started
    again, as Kubernetes restarts a pod's container, after a backoff that doubles with each death (1 s up to
    30 s) and starts over once it has run for a minute; the others keep serving meanwhile."""
    restarts = _Restarts()
    while not _stopping(stopping, make):
        for s in stack.dead():
            if s.name not in restarts.due:
                delay = restarts.died(s.name)
                print(
                    f"kubesgl: {s.name} exited with {s.proc.returncode}; restarting it in {delay:g} s",
                    file=sys.stderr,
                    flush=True,
                )
        for name in restarts.ready_to_start():
            if not stopping:
                restarts.started(name, stack.restart(name))
        for name in restarts.came_back():
            print(f"kubesgl: {name} is back (restart {restarts.count[name]})", file=sys.stderr, flush=True)
        with contextlib.suppress(InterruptedError):
            time.sleep(0.2)
    return 0


_RESTART_BACKOFF_S = (1.0, 30.0)  # first delay, cap
_RESTART_RESET_S = 60.0  # a service up this long starts its backoff over


class _Restarts:
    """Which services are waiting to be started again, when, and which restarted ones answer /ready."""

    def __init__(self) -> None:
        self.due: dict[str, float] = {}  # name -> monotonic time to start it
        self.count: dict[str, int] = {}
        self._delay: dict[str, float] = {}
        self._since: dict[str, float] = {}  # name -> when its current process started
        self._coming: dict[str, ServiceProcess] = {}  # restarted, not ready yet

    def died(self, name: str) -> float:
        now = time.monotonic()
        first, cap = _RESTART_BACKOFF_S
        if now - self._since.get(name, now) >= _RESTART_RESET_S:
            self._delay.pop(name, None)
        delay = self._delay.get(name, first)
        self._delay[name] = min(delay * 2, cap)
        self.due[name] = now + delay
        self._coming.pop(name, None)
        return delay

    def ready_to_start(self) -> list[str]:
        now = time.monotonic()
        return [n for n, at in self.due.items() if at <= now]

    def started(self, name: str, svc: ServiceProcess) -> None:
        del self.due[name]
        self.count[name] = self.count.get(name, 0) + 1
        self._since[name] = time.monotonic()
        self._coming[name] = svc

    def came_back(self) -> list[str]:
        back = [n for n, svc in self._coming.items() if svc.proc.poll() is None and http_ok(svc.ready_url)]
        for n in back:
            del self._coming[n]
        return back
