"""Continuous batching: admission, chunked prefill, decode, eviction, preemption, and turning sampled tokens
into per-request outputs, one room each; `Scheduler` wires them and plans each step."""

from kubesgl.engine.plan import StepTokens
from kubesgl.engine.scheduler.limits import SchedulerLimits
from kubesgl.engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerLimits", "StepTokens"]
