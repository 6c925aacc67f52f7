"""Where a step's time goes: host phases by wall clock, device time by CUDA events (KUBESGL_STEP_PROFILE=1).

Off by default; when on, it adds one event pair per step and no host sync beyond the read-back the loop
already does (device times are read when the step's results are).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch


@dataclass
class _Bucket:
    steps: int = 0
    schedule: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    process: float = 0.0
    device: float = 0.0


@dataclass
class StepProfile:
    buckets: dict[tuple[str, int], _Bucket] = field(default_factory=lambda: defaultdict(_Bucket))
    _t: float = 0.0

    @staticmethod
    def key(mode: str, batch: int) -> tuple[str, int]:
        return mode, 1 << max(batch - 1, 0).bit_length()  # batch sizes bucketed to powers of two

    def tick(self) -> float:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        return dt

    def events(self, on_cuda: bool) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        if not on_cuda:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        return start, end

    def report(self) -> str:
        lines = [
            f"{'mode':>6} {'bs<=':>5} {'steps':>6} | ms/step: {'sched':>6} {'launch':>6} {'wait':>6} {'process':>7} {'device':>7}"
        ]
        total = _Bucket()
        for (mode, bs), b in sorted(self.buckets.items()):
            n = max(b.steps, 1)
            lines.append(
                f"{mode:>6} {bs:>5} {b.steps:>6} | {'':8} {b.schedule / n * 1e3:6.2f} {b.launch / n * 1e3:6.2f} "
                f"{b.wait / n * 1e3:6.2f} {b.process / n * 1e3:7.2f} {b.device / n * 1e3:7.2f}"
            )
            for f in ("steps", "schedule", "launch", "wait", "process", "device"):
                setattr(total, f, getattr(total, f) + getattr(b, f))
        lines.append(
            f"totals (s): schedule {total.schedule:.2f} launch {total.launch:.2f} wait {total.wait:.2f} "
            f"process {total.process:.2f} device {total.device:.2f} over {total.steps} steps"
        )
        return "\n".join(lines)
