"""Child processes of the local launcher and the tests: die with the parent, stop gracefully, then forcibly."""

from __future__ import annotations

import atexit
import ctypes
import gc
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


def freeze_heap() -> None:
    """For a process that owns its heap (a service, a benchmark), once it has started: collects, then moves
    every object alive now (the imports, the model, the app) out of the cycle collector's view, so a full
    collection later scans only what the work made. A full collection of an engine process's ~350k startup
    objects takes ~160 ms on the 2-core box (a 288 ms stall of the H100's engine, mid-burst, was one); after
    this it is under a millisecond. What is alive now is never collected as a cycle afterwards: call it once
    the process has started, never from a library constructor (CPython's gc.freeze; vLLM's engine core and
    SGLang's scheduler do the same). At exit the heap goes back to the collector, so extensions that check
    their objects were freed at interpreter shutdown (nanobind's, under Triton) see them freed."""
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often a process calls this
    atexit.register(gc.unfreeze)


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
