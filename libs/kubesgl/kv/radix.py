"""Radix-tree prefix cache over KV pages (SGLang's RadixAttention idea, page-aligned).

Each edge holds a run of tokens whose length is a multiple of page_size, and the pages holding their KV.
Requests lock the path to the node they use (reference counts), so in-use pages are never evicted;
unreferenced leaves are evicted least-recently-used first.
"""

from __future__ import annotations

import heapq
import itertools
import time

from kubesgl.kv.kv_events import KVEvents, block_hashes
from kubesgl.kv.page_pool import PagePool


class _Node:
    __slots__ = ("children", "key", "last_access", "pages", "parent", "ref")

    def __init__(self, key: list[int], pages: list[int], parent: _Node | None) -> None:
        self.key = key
        self.pages = pages
        self.parent = parent
        self.children: dict[tuple[int, ...], _Node] = {}
        self.ref = 0
        self.last_access = time.monotonic()


class RadixCache:
    def __init__(self, page_size: int, pool: PagePool, events: KVEvents | None = None) -> None:
        self.page_size = page_size
        self.pool = pool
        self.events = events  # when set, records the blocks this cache gains and loses (cache-aware routing)
        self.root = _Node([], [], None)
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
            n = 0  # matched pages of child
            while n < len(child.pages) and at + (n + 1) * ps <= limit:
                lo = n * ps
                if child.key[lo : lo + ps] != tokens[at + lo : at + lo + ps]:
                    break
                n += 1
            if n < len(child.pages):
                child = self._split(child, n)
            child.last_access = now
            pages += child.pages
            at += len(child.key)
            node = child
        return node, pages, at

    def _split(self, node: _Node, n_pages: int) -> _Node:
        """Cuts `node` after `n_pages` pages; returns the new upper half (which keeps the parent edge)."""
        cut = n_pages * self.page_size
        parent = node.parent
        assert parent is not None
        upper = _Node(node.key[:cut], node.pages[:n_pages], parent)
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
    def match_prefix(self, tokens: list[int]) -> tuple[object, list[int]]:
        node, pages, _ = self._walk(tokens)
        self._lock(node, +1)
        return node, pages

    def insert(self, tokens: list[int], pages: list[int]) -> tuple[object, list[int]]:
        ps = self.page_size
        n_full = min(len(tokens) // ps, len(pages))
        tokens = tokens[: n_full * ps]
        node, canon, at = self._walk(tokens)
        # Our copies of pages someone else already cached hold the same KV: give ours back.
        dup = [mine for mine, theirs in zip(pages[: len(canon)], canon, strict=True) if mine != theirs]
        self.pool.free(dup)
        if at < len(tokens):
            leaf = _Node(tokens[at:], pages[len(canon) : n_full], node)
            node.children[self._edge(leaf.key, 0)] = leaf
            self._cached += len(leaf.pages)
            if self.events is not None:
                self.events.on_range(tokens, at, len(tokens), stored=True)
            canon = canon + leaf.pages
            node = leaf
        self._lock(node, +1)
        return node, canon

    def release(self, handle: object) -> None:
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
                prefix = self._path_tokens(leaf)
                self.events.on_range(prefix, len(prefix) - len(leaf.key), len(prefix), stored=False)
            self._cached -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, next(self._tick), parent))
        return freed

    def block_hashes(self, block_size: int) -> list[int]:
        """Every whole block the cache holds now, as KV-event hashes (a router's snapshot; O(cached tokens))."""
        out: list[int] = []
        tokens: list[int] = []  # the path from the root to the node being visited
        chain: list[int] = []  # chain[j] = hash of block j of that path
        stack: list[tuple[_Node, int, int] | _Node] = list(self.root.children.values())
        while stack:
            item = stack.pop()
            if isinstance(item, tuple):  # leaving a node: back to its parent's path
                _, n_tokens, n_blocks = item
                del tokens[n_tokens:], chain[n_blocks:]
                continue
            stack.append((item, len(tokens), len(chain)))
            tokens += item.key
            new = block_hashes(tokens, block_size, start_block=len(chain), parent=chain[-1] if chain else 0)
            chain += new
            out += new
            stack.extend(item.children.values())
        return out

    def _path_tokens(self, node: _Node) -> list[int]:
        keys = []
        while node is not None and node is not self.root:
            keys.append(node.key)
            node = node.parent
        return [t for key in reversed(keys) for t in key]

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self.root]
        while stack:
            n = stack.pop()
            if n.children:
                stack.extend(n.children.values())
            elif n is not self.root:
                out.append(n)
        return out
