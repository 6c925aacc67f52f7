"""Where a step's time goes: host phases by wall clock, device time by CUDA events (KUBESGL_STEP_PROFILE=1).

`StepProfile` is a `StepHook`: the engine calls it at each phase of a step, and calls nothing when no hook is
set. When on, it adds one event pair per step and no host sync beyond the read-back the loop already does
(device times are read when the step's results are).
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kubesgl.engine.plan import BatchPlan


class StepHook(Protocol):
    """The phases of `Engine.step`, in order; with overlap scheduling a plan is read back one step after it
    was launched, so `read_back`/`processed` name an earlier plan than `scheduled`/`launched`."""

    def step_started(self) -> None: ...

    def scheduled(self, plan: BatchPlan) -> None:
        """The scheduler planned `plan`; it is about to be broadcast and launched."""
        ...

    def launched(self, plan: BatchPlan) -> None: ...

    def read_back(self, plan: BatchPlan) -> None:
        """The host holds the sampled tokens of `plan`."""
        ...

    def processed(self, plan: BatchPlan) -> None:
        """The scheduler applied the tokens of `plan`."""
        ...


@dataclass
class _Bucket:
    steps: int = 0
    schedule: float = 0.0
    launch: float = 0.0
    wait: float = 0.0
    process: float = 0.0
    device: float = 0.0


_Events = tuple[torch.cuda.Event, torch.cuda.Event]


@dataclass
class StepProfile:
    """Per (mode, batch size bucket): steps and mean milliseconds per phase."""

    on_cuda: bool = False
    buckets: dict[tuple[str, int], _Bucket] = field(default_factory=lambda: defaultdict(_Bucket))
    _t: float = 0.0
    _scheduled: tuple[float, _Events | None] = (0.0, None)
    _launched: dict[int, tuple[float, float, _Events | None]] = field(default_factory=dict)  # by id(plan)
    _wait: float = 0.0

    @staticmethod
    def key(plan: BatchPlan) -> tuple[str, int]:
        """(mode, batch size bucketed to a power of two); a mixed step is "mixed", sized by its decode rows."""
        mode, batch = ("mixed", plan.num_decode) if plan.num_decode else (plan.mode, plan.batch_size)
        return mode, 1 << max(batch - 1, 0).bit_length()

    def _tick(self) -> float:
        now = time.perf_counter()
        dt, self._t = now - self._t, now
        return dt

    def step_started(self) -> None:
        self._tick()

    def scheduled(self, plan: BatchPlan) -> None:
        t_sched = self._tick()
        events = None
        if self.on_cuda:
            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        self._scheduled = (t_sched, events)

    def launched(self, plan: BatchPlan) -> None:
        t_sched, events = self._scheduled
        if events is not None:
            events[1].record()
        self._launched[id(plan)] = (t_sched, self._tick(), events)

    def read_back(self, plan: BatchPlan) -> None:
        self._wait = self._tick()

    def processed(self, plan: BatchPlan) -> None:
        t_sched, t_launch, events = self._launched.pop(id(plan))
        b = self.buckets[self.key(plan)]
        b.steps += 1
        b.schedule += t_sched
        b.launch += t_launch
        b.wait += self._wait
        b.process += self._tick()
        b.device += events[0].elapsed_time(events[1]) / 1e3 if events is not None else 0.0

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
