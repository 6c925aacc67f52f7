"""What a scheduler instance says about itself: Heartbeat (and its timing), its prefix cache's KvEvents and
KvSnapshot for the routers, SchedulerStats for operators and tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from kubesgl.protocol.message import Message

HEARTBEAT_INTERVAL_S = 1.0
# A scheduler missing this many heartbeats in a row is considered gone.
HEARTBEAT_MISSES_TO_EXPIRE = 3


@dataclass
class Heartbeat(Message):
    """A scheduler instance announcing itself and its load; its absence for a few intervals means it is gone."""

    instance_id: str
    model: str
    context_len: int
    page_size: int
    num_pages: int
    running: int
    queued: int
    free_pages: int
    available_pages: int
    max_running_requests: int
    draining: bool
    ts: float
    # Prefix-cache KV events: block size in tokens (0 = not published), this process's epoch, last seq sent.
    kv_block_size: int = 0
    kv_epoch: str = ""
    kv_seq: int = 0
    role: str = "both"  # --disaggregation-mode: prefill | decode | both (engine/scheduler/disagg.py)


@dataclass
class KvEvents(Message):
    """scheduler -> routers: prefix blocks its cache stored and removed since the previous batch.

    `seq` counts batches from 1 within one `epoch` (a process start), so a router sees a lost batch as a gap;
    `stored` and `removed` are disjoint (kubesgl.kv.kv_events block hashes of `block_size` tokens).
    """

    instance_id: str
    epoch: str
    seq: int
    block_size: int
    stored: list[int] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)


@dataclass
class KvSnapshot(Message):
    """Reply on kv_snapshot_subject: every block the instance's cache holds, as of batch `seq` of `epoch`."""

    instance_id: str
    epoch: str
    seq: int
    block_size: int
    blocks: list[int] = field(default_factory=list)


@dataclass
class SchedulerStats(Message):
    """Reply on stats_subject: the engine's counters, for operators and tests (e.g. pages back after abort)."""

    instance_id: str
    running: int
    queued: int
    free_pages: int
    available_pages: int
    total_pages: int
    cached_prefix_pages: int
    active_rids: list[str] = field(default_factory=list)
    draining: bool = False
