"""The KV memory requests run in: slots, pages (evicting from the prefix cache when short), what the prefix cache
shares at admission and takes back at release, and preemption when memory runs out."""

from __future__ import annotations

from kubesgl.engine.plan import BatchPlan, SlotInit
from kubesgl.engine.request import Req
from kubesgl.engine.scheduler.limits import SchedulerCounters
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import CacheHandle, PrefixCache


class Memory:
    def __init__(self, pool: PagePool, cache: PrefixCache, slots: int, counters: SchedulerCounters) -> None:
        self.pool = pool
        self.cache = cache
        self.counters = counters
        self.running: list[Req] = []  # the requests holding a slot and pages
        self._free_slots = list(range(slots - 1, -1, -1))
        # Page-table rows the prefix cache changed outside a plan (its canonical pages replaced ours).
        self._pending_page_writes: list[tuple[Req, int, int, list[int]]] = []

    @property
    def has_free_slot(self) -> bool:
        return bool(self._free_slots)

    def pages_short(self, req: Req, tokens: int) -> int:
        """Pages the request still needs to hold KV for `tokens` tokens."""
        return self.pool.pages_for(tokens) - len(req.pages)

    def decode_pages(self, batch: list[Req]) -> int:
        """Pages a decode step of `batch` allocates."""
        return sum(self.pages_short(r, r.kv_len + 1) for r in batch)

    def make_room(self, pages: int) -> bool:
        """Evicts from the prefix cache until `pages` pages are free; False when it cannot."""
        short = pages - self.pool.num_free
        if short > 0:
            self.cache.evict(short)
        return self.pool.num_free >= pages

    def admit(self, req: Req, plan: BatchPlan) -> None:
        """Gives the request a slot and the KV of its longest cached prefix."""
        first = req.cached_tokens < 0
        handle, pages = self.cache.match_prefix(req.all_ids[: req.cacheable_len])
        req.admit(self._free_slots.pop(), handle, pages, self.pool.page_size)
        if first:
            self.counters.prompt_tokens += len(req.input_ids)
            self.counters.cached_tokens += req.kv_len
        if pages:
            plan.page_writes.append((req.slot, 0, list(pages)))
        plan.slot_inits.append(SlotInit(req.slot, len(req.input_ids), req.params, req.seed))
        self.running.append(req)

    def unadmit(self, req: Req, plan: BatchPlan) -> None:
        """Takes back an admission that found no memory, and its writes to the plan."""
        plan.page_writes = [w for w in plan.page_writes if w[0] != req.slot]
        plan.slot_inits = [s for s in plan.slot_inits if s.slot != req.slot]
        self.running.remove(req)
        self.cache.release(req.cache_handle)
        self._free_slots.append(req.slot)
        req.release()

    def grow(self, req: Req, n: int, plan: BatchPlan) -> None:
        """Allocates `n` more pages to the request (room was made)."""
        if n > 0:
            new = self.pool.alloc(n)
            plan.page_writes.append((req.slot, len(req.pages), new))
            req.pages += new

    def release(self, req: Req) -> None:
        """Gives the request's KV to the prefix cache (what is reusable) and the pool (the rest)."""
        self.cache_prefix(req, min(req.kv_len, req.num_known))
        self.cache.release(req.cache_handle)
        self.pool.free(req.pages[req.tree_pages :])
        self._free_slots.append(req.slot)
        self.running.remove(req)
        req.release()

    def hand_off(self, req: Req) -> tuple[CacheHandle | None, list[int]]:
        """The request leaves for a decode instance: its slot and uncached pages go back; the lock on its
        prompt's cached pages and those pages are returned, held until the transfer ends."""
        self.cache_prefix(req, req.prefill_target)
        lock, pages = req.cache_handle, req.pages[: req.tree_pages]
        req.cache_handle = None
        self.pool.free(req.pages[req.tree_pages :])
        self._free_slots.append(req.slot)
        self.running.remove(req)
        req.release()
        return lock, pages

    def preempt(self, req: Req) -> None:
        """Releases a running request's memory; it waits again (the caller queues it)."""
        self.counters.preemptions += 1
        self.release(req)

    def cache_prefix(self, req: Req, num_tokens: int) -> None:
        """Puts the full pages of the request's first `num_tokens` tokens in the prefix cache; the request
        keeps them, now owned and locked by the cache (an identical copy cached meanwhile replaces ours)."""
        n_full = num_tokens // self.pool.page_size
        handle, canon = self.cache.insert(req.all_ids[: n_full * self.pool.page_size], req.pages[:n_full])
        self.cache.release(req.cache_handle)
        if req.hold_cached_prefix(handle, canon):
            self._pending_page_writes.append((req, req.slot, 0, list(canon)))

    def take_page_writes(self) -> list[tuple[int, int, list[int]]]:
        """The page-table writes `cache_prefix` left for the next plan, of requests still in their slot."""
        live = [(s, i, p) for r, s, i, p in self._pending_page_writes if r.slot == s]
        self._pending_page_writes = []
        return live
