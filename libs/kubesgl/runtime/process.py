"""Child processes of the local launcher and the tests: die with the parent, stop gracefully, then forcibly."""

from __future__ import annotations

import ctypes
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1


def parent_death_signal() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (Linux), so a killed launcher leaves no orphans.

    Linux ties this to the spawning *thread*: spawn from a long-lived thread (not asyncio.to_thread's pool),
    or the child is signalled when that worker thread exits."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def terminate(procs: Sequence[subprocess.Popen[bytes]], timeout_s: float) -> None:
    """SIGTERM every live process, wait up to `timeout_s` for all of them, SIGKILL the stragglers."""
    live = [p for p in procs if p.poll() is None]
    for p in live:
        p.send_signal(signal.SIGTERM)
    end = time.monotonic() + timeout_s
    for p in live:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
