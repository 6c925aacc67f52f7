"""Radix-tree prefix cache over KV pages (SGLang's RadixAttention idea, page-aligned).

Each edge holds a run of tokens whose length is a multiple of page_size, and the pages holding their KV.
Requests lock the path to the node they use (reference counts), so in-use pages are never evicted;
unreferenced leaves are evicted least-recently-used first.

With KV events on, each node keeps the chained hashes of the blocks whose last token lies in its edge, so an
insert hashes only its new blocks (chained from the nearest hash above it) and eviction reports the leaf's own.
"""

from __future__ import annotations

import heapq
import itertools
import time

from kubesgl.kv.kv_events import KVEvents, block_hashes
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import CacheHandle


class _Node:
    __slots__ = ("children", "hashes", "key", "last_access", "pages", "parent", "ref")

    def __init__(self, key: list[int], pages: list[int], parent: _Node | None, hashes: list[int]) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.hashes = hashes  # KV-event hashes of the blocks that end inside `key` ([] when events are off)
        self.children: dict[tuple[int, ...], _Node] = {}
        self.ref = 0
        self.last_access = time.monotonic()


class RadixCache:
    def __init__(self, page_size: int, pool: PagePool, events: KVEvents | None = None) -> None:
        self.page_size = page_size
        self.pool = pool
        self.events = events  # when set, records the blocks this cache gains and loses (cache-aware routing)
        self.root = _Node([], [], None, [])
        self.root.ref = 1  # the root is never evicted
        self._cached = 0
        self._protected = 0
        self._tick = itertools.count()

    # -- accounting ------------------------------------------------------------------------------
    @property
    def cached_pages(self) -> int:
        return self._cached

    @property
    def evictable_pages(self) -> int:
        return self._cached - self._protected

    # -- lookups -----------------------------------------------------------------------------------
    def _edge(self, tokens: list[int], at: int) -> tuple[int, ...]:
        return tuple(tokens[at : at + self.page_size])

    def _walk(self, tokens: list[int]) -> tuple[_Node, list[int], int]:
        """Follows full pages of `tokens` as far as cached; splits a node matched partway."""
        ps = self.page_size
        node, pages, at = self.root, [], 0
        limit = len(tokens) - len(tokens) % ps
        now = time.monotonic()
        while at < limit:
            child = node.children.get(self._edge(tokens, at))
            if child is None:
                break
            n = min(len(child.pages), (limit - at) // ps)  # pages of child that `tokens` reaches
            ours, theirs = tokens[at : at + n * ps], child.key[: n * ps]
            if ours != theirs:  # one list compare in C; find the page only on a mismatch
                n = next(i for i, (x, y) in enumerate(zip(ours, theirs, strict=True)) if x != y) // ps
            if n < len(child.pages):
                child = self._split(child, n, at)
            child.last_access = now
            pages += child.pages
            at += len(child.key)
            node = child
        return node, pages, at

    def _split(self, node: _Node, n_pages: int, start: int) -> _Node:
        """Cuts `node` (whose edge starts `start` tokens deep) after `n_pages` pages; returns the new upper half
        (which keeps the parent edge)."""
        cut = n_pages * self.page_size
        parent = node.parent
        assert parent is not None
        n_upper = 0  # hashes the upper half takes: a block goes with its last token (a page cut may split it)
        if self.events is not None:
            b = self.events.block_size
            n_upper = (start + cut) // b - start // b
        upper = _Node(node.key[:cut], node.pages[:n_pages], parent, node.hashes[:n_upper])
        node.hashes = node.hashes[n_upper:]
        upper.ref = node.ref
        upper.last_access = node.last_access
        parent.children[self._edge(node.key, 0)] = upper
        node.key, node.pages, node.parent = node.key[cut:], node.pages[n_pages:], upper
        upper.children[self._edge(node.key, 0)] = node
        return upper

    def _lock(self, node: _Node, delta: int) -> None:
        while node is not None:
            if node is not self.root:
                if node.ref == 0 and delta > 0:
                    self._protected += len(node.pages)
                elif node.ref == 1 and delta < 0:
                    self._protected -= len(node.pages)
            node.ref += delta
            node = node.parent

    # -- the PrefixCache interface -----------------------------------------------------------------
    def match_prefix(self, tokens: list[int]) -> tuple[CacheHandle, list[int]]:
        node, pages, _ = self._walk(tokens)
        self._lock(node, +1)
        return node, pages

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[CacheHandle, list[int]]:
        ps = self.page_size
        n_full = min(len(tokens) // ps, len(pages))
        tokens = tokens[: n_full * ps]
        node, canon, at = self._walk(tokens)
        # Our copies of pages someone else already cached hold the same KV: give ours back.
        dup = [mine for mine, theirs in zip(pages[: len(canon)], canon, strict=True) if mine != theirs]
        self.pool.free(dup)
        if at < len(tokens):
            hashes: list[int] = []
            if self.events is not None:  # only the blocks ending in the new edge; the ones above are cached
                b = self.events.block_size
                hashes = block_hashes(tokens, b, start_block=at // b, parent=self._last_hash(node))
                self.events.on_stored(hashes)
            leaf = _Node(tokens[at:], pages[len(canon) : n_full], node, hashes)
            node.children[self._edge(leaf.key, 0)] = leaf
            self._cached += len(leaf.pages)
            canon = canon + leaf.pages
            node = leaf
        self._lock(node, +1)
        return node, canon

    def release(self, handle: CacheHandle | None) -> None:
        if handle is not None:
            self._lock(handle, -1)  # type: ignore[arg-type]

    def evict(self, num_pages: int) -> int:
        heap = [(n.last_access, next(self._tick), n) for n in self._leaves() if n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            del parent.children[self._edge(leaf.key, 0)]
            self.pool.free(leaf.pages)
            freed += len(leaf.pages)
            if self.events is not None:
                self.events.on_removed(leaf.hashes)
            self._cached -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return freed

    def block_hashes(self, block_size: int) -> list[int]:
        """Every whole block the cache holds now, as KV-event hashes (a router's snapshot; no hashing)."""
        if self.events is None or block_size != self.events.block_size:
            have = self.events.block_size if self.events is not None else "no KV events"
            raise ValueError(
                f"a snapshot in blocks of {block_size} tokens needs KV events of that size ({have})"
            )
        out: list[int] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out += node.hashes
            stack.extend(node.children.values())
        return out

    def _last_hash(self, node: _Node) -> int:
        """Hash of the last block ending at or above the end of `node` (0 if none: the chain's start)."""
        while not node.hashes and node.parent is not None:
            node = node.parent  # a run of hashless edges spans less than a block, so this stops soon
        return node.hashes[-1] if node.hashes else 0

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out
