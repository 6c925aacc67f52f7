"""The cache-aware router: prefix overlap with each instance's cache, traded against the instance's load.

score = w_overlap * (leading request blocks the instance holds / request blocks) - w_load * instance_load.
With the default weights a whole-prompt hit is worth as much as one instance being a full batch busier than
another, so a hot prefix spreads once its instance is saturated instead of queueing there. An instance whose
events cannot be trusted (out of sync, stale) counts no overlap, which leaves plain least-load.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubesgl.cache_routing.kv_tracker import KvTracker
from kubesgl.cache_routing.load import instance_load
from kubesgl.kv.kv_events import block_hashes
from kubesgl.routing import Candidate


@dataclass(frozen=True)
class CacheAwareWeights:
    overlap: float = 1.0
    load: float = 1.0


@dataclass(frozen=True)
class Decision:
    instance_id: str
    overlap: (
        float  # share of the request's blocks the chosen instance holds (0 when it has fewer than a block)
    )
    reason: str  # "prefix": the choice holds part of the prompt; "load": no usable overlap anywhere


class CacheAwareRouter:
    def __init__(self, tracker: KvTracker, weights: CacheAwareWeights | None = None) -> None:
        self.tracker = tracker
        self.weights = weights or CacheAwareWeights()

    def route(self, request_tokens: Sequence[int], candidates: Sequence[Candidate]) -> str:
        return self.decide(request_tokens, candidates).instance_id

    def decide(self, request_tokens: Sequence[int], candidates: Sequence[Candidate]) -> Decision:
        hashes = block_hashes(list(request_tokens), self.tracker.block_size)
        trusted = [c.instance_id for c in candidates if self.tracker.fresh(c.instance_id)]
        matched = self.tracker.index.matched_blocks(hashes, trusted)
        n = max(len(hashes), 1)
        w = self.weights

        def rank(c: Candidate) -> tuple[float, int, int, str]:
            score = w.overlap * matched.get(c.instance_id, 0) / n - w.load * instance_load(c)
            return (-score, c.load, -c.heartbeat.available_pages, c.instance_id)

        best = min(candidates, key=rank)
        held = matched.get(best.instance_id, 0)
        self.tracker.index.predict(best.instance_id, hashes)
        return Decision(best.instance_id, held / n, "prefix" if held else "load")
