"""Prefill/decode disaggregation: the scheduler's side of the `prefill` and `decode` roles (SGLang's
--disaggregation-mode). `both`, the default, is the colocated scheduler with neither role object.

The decode instance owns the request: it asks a prefill instance for the prompt, receives a KvHandoff (the first
token, already sampled there, and the descriptors of the prompt's full KV pages), reports that token at once,
pulls the pages through the transfer engine (kv/kv_transfer.py) into its own pool, puts them in its prefix
cache, and queues the request with its tokens so far (Admission.add_with_tokens): its prefill then finds the
prompt cached and computes only the last partial page and the first token. A failed or late transfer, or no
handoff at all (a dead prefill instance), queues the same request without the pages: it is prefilled here,
never lost.
"""

from __future__ import annotations

import enum
import logging
import time
from dataclasses import dataclass

from kubesgl.engine.request import ReqState
from kubesgl.engine.scheduler.scheduler import Scheduler
from kubesgl.kv.kv_cache import KVCache
from kubesgl.kv.kv_transfer import KvTransferAgent, TransferState
from kubesgl.kv.prefix_cache import CacheHandle
from kubesgl.values.outputs import RequestOutput, TokenLogprob
from kubesgl.values.sampling import SamplingParams

log = logging.getLogger("kubesgl.scheduler.pd")


class DisaggregationMode(enum.StrEnum):
    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass(frozen=True)
class KvHandoff:
    """What a prefill instance sends the decode instance once the prompt is computed (bytes and lists only)."""

    rid: str
    seed: int
    output: RequestOutput  # the first token(s), prompt logprobs, cached_tokens
    logprobs: list[TokenLogprob]
    num_pages: int  # the prompt's full pages described
    agent_metadata: bytes
    descs: bytes


@dataclass
class TransferCounters:
    transfers: int = 0
    transferred_bytes: int = 0
    fallbacks: int = 0


class TransferOutcome(enum.StrEnum):
    """How a handoff's pull ended: `ok`, or why its request went on without the pages (prefilled here)."""

    OK = "ok"
    NO_ROOM = "no_room"  # this pool could not hold them
    UNREACHABLE = "unreachable"  # the read could not start (the prefill agent is gone, another KV geometry)
    FAILED = "failed"  # the read started and failed
    LATE = "late"  # still running past the timeout
    PEER_GONE = "peer_gone"  # still running when the prefill instance was declared dead
    ABORTED = "aborted"  # the request was aborted during the pull


@dataclass(frozen=True)
class TransferEnd:
    """One handoff's pull, once its outcome is known (what its trace span and metrics are made from)."""

    rid: str
    outcome: TransferOutcome
    pages: int
    nbytes: int  # the KV of those pages (moved only when the outcome is ok)
    started_ns: int  # wall clock
    seconds: float  # from the start to the outcome (monotonic)


class PrefillRole:
    """Computes prompts for decode instances; holds each prompt's pages until the decode side has read them."""

    def __init__(self, scheduler: Scheduler, agent: KvTransferAgent) -> None:
        self.scheduler = scheduler
        self.agent = agent
        self._locks: dict[str, tuple[CacheHandle | None, float]] = {}

    def add(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        self.scheduler.add_request(rid, input_ids, params, hand_off=True)

    def take_handoffs(self) -> list[KvHandoff]:
        """Requests prefilled since the last call, as handoffs; their pages stay locked until `release`."""
        out = []
        for h in self.scheduler.take_handed_off():
            self._locks[h.rid] = (h.lock, time.monotonic())
            descs = self.agent.describe(h.pages) if h.pages else b""  # a prompt shorter than a page
            out.append(
                KvHandoff(h.rid, h.seed, h.output, h.logprobs, len(h.pages), self.agent.metadata(), descs)
            )
        return out

    def release(self, rid: str) -> None:
        """The decode side has read the pages, or no longer wants them (it gave up, or its request ended): a
        handed-off prompt's pages become evictable cache again; a prompt still being computed is aborted."""
        if rid in self._locks:
            lock, _ = self._locks.pop(rid)
            self.scheduler.cache.release(lock)
        else:
            self.scheduler.abort(rid)

    def release_older_than(self, seconds: float) -> list[str]:
        """Unlocks handoffs no decode instance finished in time (it died); returns their rids."""
        now = time.monotonic()
        stale = [rid for rid, (_, at) in self._locks.items() if now - at > seconds]
        for rid in stale:
            self.release(rid)
        return stale


@dataclass
class _Pull:
    tid: int
    pages: list[int]
    input_ids: list[int]
    params: SamplingParams
    handoff: KvHandoff
    started: float
    started_ns: int
    queued: bool = False  # given up on (late, aborted): the request went ahead without these pages


class DecodeRole:
    """Receives handoffs: pulls their pages, then queues their requests with KV present, or falls back."""

    def __init__(self, scheduler: Scheduler, agent: KvTransferAgent, timeout_s: float = 10.0) -> None:
        self.scheduler = scheduler
        self.agent = agent
        self.timeout_s = timeout_s
        self.counters = TransferCounters()
        kv = agent.kv
        self._page_bytes = kv.page_size * KVCache.bytes_per_token(
            kv.num_layers, kv.num_kv_heads, kv.head_dim, kv.dtype
        )
        self._pulls: dict[str, _Pull] = {}
        self._ended: list[TransferEnd] = []
        self._held: dict[
            str, CacheHandle | None
        ] = {}  # locks on pulled pages until their request is admitted

    def receive(self, input_ids: list[int], params: SamplingParams, handoff: KvHandoff) -> RequestOutput:
        """Starts pulling the handoff's pages; returns its first output, for the caller to report now."""
        mem, pool = self.scheduler.memory, self.scheduler.pool
        started, started_ns = time.monotonic(), time.time_ns()
        if handoff.num_pages == 0:  # a prompt shorter than a page: nothing to pull
            self._queue(input_ids, params, handoff, fallback=False)
            return handoff.output
        if not mem.make_room(handoff.num_pages):
            self._end(handoff, TransferOutcome.NO_ROOM, started, started_ns)
            self._queue(input_ids, params, handoff, fallback=True)
            return handoff.output
        pages = pool.alloc(handoff.num_pages)
        try:
            tid = self.agent.read(handoff.agent_metadata, handoff.descs, pages)
        except Exception as e:  # a peer NIXL cannot reach, or a description that does not fit this pool
            log.warning("cannot pull %s's pages (%s): prefilling it here", handoff.rid, e)
            pool.free(pages)
            self._end(handoff, TransferOutcome.UNREACHABLE, started, started_ns)
            self._queue(input_ids, params, handoff, fallback=True)
            return handoff.output
        self._pulls[handoff.rid] = _Pull(tid, pages, input_ids, params, handoff, started, started_ns)
        return handoff.output

    def prefill_here(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        """No handoff came (the prefill instance died or refused): the request is prefilled on this instance."""
        self.counters.fallbacks += 1
        self.scheduler.add_request(rid, input_ids, params)

    def abort(self, rid: str) -> None:
        """An aborted request in transfer is dropped when its pull ends; a queued one aborts as usual."""
        pull = self._pulls.get(rid)
        if pull is not None and not pull.queued:
            pull.queued = True  # its pull only frees its pages when done; the request ends now, as aborted
            self._end(pull.handoff, TransferOutcome.ABORTED, pull.started, pull.started_ns)
            self._queue(pull.input_ids, pull.params, pull.handoff, fallback=False)
        self.scheduler.abort(rid)

    def give_up(self, rid: str) -> None:
        """The pull's prefill instance is gone: its request goes on without the pages (prefilled here) now,
        not at the timeout; the pages are freed when NIXL lets go of them."""
        pull = self._pulls.get(rid)
        if pull is not None and not pull.queued:
            self._go_without(pull, TransferOutcome.PEER_GONE)

    def poll(self) -> list[str]:
        """Advances the pulls (the engine loop calls it every step); returns the rids whose pulls ended."""
        self._unlock_admitted()
        ended = []
        now = time.monotonic()
        for rid, pull in list(self._pulls.items()):
            state = self.agent.poll(pull.tid)
            if state is TransferState.RUNNING:
                if not pull.queued and now - pull.started > self.timeout_s:
                    self._go_without(pull, TransferOutcome.LATE)
                continue
            del self._pulls[rid]
            ended.append(rid)
            if state is TransferState.DONE and not pull.queued:
                self._cache(pull)
                end = self._end(pull.handoff, TransferOutcome.OK, pull.started, pull.started_ns)
                self.counters.transfers += 1
                self.counters.transferred_bytes += end.nbytes
                self._queue(pull.input_ids, pull.params, pull.handoff, fallback=False)
            else:
                self.scheduler.pool.free(pull.pages)
                if not pull.queued:
                    self._end(pull.handoff, TransferOutcome.FAILED, pull.started, pull.started_ns)
                    self._queue(pull.input_ids, pull.params, pull.handoff, fallback=True)
        return ended

    def _go_without(self, pull: _Pull, outcome: TransferOutcome) -> None:
        pull.queued = True  # its pages are freed when NIXL lets go of them
        self._end(pull.handoff, outcome, pull.started, pull.started_ns)
        self._queue(pull.input_ids, pull.params, pull.handoff, fallback=True)

    def take_ended(self) -> list[TransferEnd]:
        """The pulls whose outcome came since the last call (the bus side makes their spans and metrics)."""
        out, self._ended = self._ended, []
        return out

    @property
    def busy(self) -> bool:
        return bool(self._pulls)

    def pulling(self, rid: str) -> bool:
        return rid in self._pulls

    def _cache(self, pull: _Pull) -> None:
        """The pulled pages join the prefix cache under the prompt's tokens (copies of pages it already has
        go back to the pool), locked until the request is admitted."""
        tokens = pull.input_ids[: len(pull.pages) * self.scheduler.pool.page_size]
        handle, _ = self.scheduler.cache.insert(tokens, pull.pages)
        self._held[pull.handoff.rid] = handle

    def _end(self, h: KvHandoff, outcome: TransferOutcome, started: float, started_ns: int) -> TransferEnd:
        end = TransferEnd(
            h.rid,
            outcome,
            h.num_pages,
            h.num_pages * self._page_bytes,
            started_ns,
            time.monotonic() - started,
        )
        self._ended.append(end)
        return end

    def _queue(self, input_ids: list[int], params: SamplingParams, h: KvHandoff, fallback: bool) -> None:
        self.counters.fallbacks += fallback
        out = h.output
        self.scheduler.admission.add_with_tokens(
            h.rid, input_ids, params, h.seed, out.new_token_ids, h.logprobs, out.cached_tokens
        )

    def _unlock_admitted(self) -> None:
        for rid in list(self._held):
            req = self.scheduler.reqs.get(rid)
            if req is None or req.state is not ReqState.WAITING:
                self.scheduler.cache.release(self._held.pop(rid))
