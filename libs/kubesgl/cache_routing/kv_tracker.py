"""Keeps a router's PrefixIndex in step with each instance's KV event stream, and says when it cannot.

Per instance: the epoch (one scheduler process; a restart under the same id is a new epoch) and the last
batch applied. A batch that skips a seq, a heartbeat whose kv_seq stays ahead of what arrived for a whole
interval, or a new epoch means events were lost: the instance is out of sync until a snapshot (which carries
the seq it is current to) replaces its blocks; batches that arrive meanwhile are buffered and replayed on top.
An out-of-sync instance, or one not heard from for `stale_after_s`, counts no overlap (routing falls back to
load) — a wrong index would send requests to a cold instance with confidence.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from kubesgl.cache_routing.prefix_index import PrefixIndex
from kubesgl.protocol import Heartbeat, KvEvents, KvSnapshot

_MAX_BUFFERED = 1024  # batches kept while waiting for a snapshot; an overflow just means another snapshot


@dataclass
class _Sync:
    epoch: str
    heard: float
    seq: int = 0
    synced: bool = False
    announced: int | None = None  # a heartbeat's kv_seq not yet applied at that time
    buffered: dict[int, KvEvents] = field(default_factory=dict)


class KvTracker:
    def __init__(
        self,
        index: PrefixIndex,
        block_size: int,
        stale_after_s: float = 2.5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.index = index
        self.block_size = block_size
        self.stale_after_s = stale_after_s
        self._clock = clock
        self._sync: dict[str, _Sync] = {}

    def usable(self, hb: Heartbeat) -> bool:
        """Whether this router can read the instance's events (same block size, events on)."""
        return hb.kv_block_size == self.block_size > 0

    def on_heartbeat(self, hb: Heartbeat) -> bool:
        """Notes a heartbeat; True when the instance needs a (new) snapshot."""
        if not self.usable(hb) or hb.draining:
            self.forget(hb.instance_id)
            return False
        st = self._state(hb.instance_id, hb.kv_epoch)
        st.heard = self._clock()
        if not st.synced:
            return True
        if st.announced is not None and st.seq < st.announced:  # announced a whole interval ago, never came
            st.synced = False
            return True
        st.announced = hb.kv_seq if hb.kv_seq > st.seq else None
        return False

    def on_events(self, ev: KvEvents) -> bool:
        """Applies a batch in order; True when the instance needs a snapshot (gap, new epoch, not synced)."""
        if ev.block_size != self.block_size:
            return False
        st = self._state(ev.instance_id, ev.epoch)
        st.heard = self._clock()
        if st.synced and ev.seq <= st.seq:
            return False  # a duplicate
        if st.synced and ev.seq == st.seq + 1:
            self._apply(ev.instance_id, st, ev)
            return False
        st.synced = False
        st.buffered[ev.seq] = ev
        while len(st.buffered) > _MAX_BUFFERED:
            del st.buffered[min(st.buffered)]
        return True

    def on_snapshot(self, snap: KvSnapshot) -> bool:
        """Replaces the instance's blocks and replays later buffered batches; True if still out of sync."""
        if snap.block_size != self.block_size:
            return False
        st = self._state(snap.instance_id, snap.epoch)
        st.heard = self._clock()
        self.index.replace(snap.instance_id, snap.blocks)
        st.seq, st.synced = snap.seq, True
        if st.announced is not None and st.announced <= st.seq:
            st.announced = None
        pending, st.buffered = st.buffered, {}
        for seq in sorted(s for s in pending if s > st.seq):
            if seq != st.seq + 1:
                st.synced = False  # a batch after the snapshot is missing: snapshot again
                st.buffered = {s: pending[s] for s in pending if s >= seq}
                return True
            self._apply(snap.instance_id, st, pending[seq])
        return False

    def fresh(self, instance_id: str) -> bool:
        """In sync and heard from recently: its overlap can be trusted."""
        st = self._sync.get(instance_id)
        return st is not None and st.synced and self._clock() - st.heard <= self.stale_after_s

    def forget(self, instance_id: str) -> None:
        self._sync.pop(instance_id, None)
        self.index.forget(instance_id)

    def retain(self, instance_ids: Iterable[str]) -> list[str]:
        """Forgets every tracked instance not in `instance_ids` (gone or draining); returns those forgotten."""
        keep = set(instance_ids)
        gone = [i for i in {*self._sync, *self.index.instances()} if i not in keep]
        for instance_id in gone:
            self.forget(instance_id)
        return gone

    def _state(self, instance_id: str, epoch: str) -> _Sync:
        st = self._sync.get(instance_id)
        if st is None or st.epoch != epoch:  # first sight, or the instance restarted: its old blocks are gone
            self.index.forget(instance_id)
            st = self._sync[instance_id] = _Sync(epoch, self._clock())
        return st

    def _apply(self, instance_id: str, st: _Sync, ev: KvEvents) -> None:
        self.index.remove(instance_id, ev.removed)
        self.index.store(instance_id, ev.stored)
        st.seq = ev.seq
