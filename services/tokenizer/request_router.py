"""Picks the instance for one request: the session's instance when affinity is on (unless it is overloaded),
otherwise the routing policy; records each decision's outcome, latency and prefix overlap."""

from __future__ import annotations

import time
from collections.abc import Sequence

from kubesgl.cache_routing.affinity import session_instance
from kubesgl.cache_routing.cache_aware import CacheAwareRouter
from kubesgl.routing import Candidate, LeastLoadRouter, Router, disaggregated
from kubesgl.runtime.telemetry.metrics import RouterMetrics

_OUTCOME = {"least-load": "load", "round-robin": "turn"}


class RequestRouter:
    def __init__(
        self,
        policy: str,
        router: Router,
        metrics: RouterMetrics,
        affinity_max_load: float | None = None,
    ) -> None:
        self.policy = policy
        self.router = router
        self.metrics = metrics
        self.affinity_max_load = affinity_max_load  # None: no session affinity

    def pick_pair(
        self, request_tokens: Sequence[int], session_id: str | None, candidates: Sequence[Candidate]
    ) -> tuple[str, str]:
        """(the instance the request goes to, the prefill instance it names, "" for none). With prefill and
        decode instances live, the request goes to the least-loaded decode instance, which owns its stream,
        and the policy (prefix-cache score and load) picks the prefill instance for its prompt."""
        roles = disaggregated(candidates)
        if roles is None:
            return self.pick(request_tokens, session_id, candidates), ""
        decode, prefill = roles
        return LeastLoadRouter().route(request_tokens, decode), self.pick(request_tokens, session_id, prefill)

    def pick(
        self, request_tokens: Sequence[int], session_id: str | None, candidates: Sequence[Candidate]
    ) -> str:
        start = time.perf_counter()
        if session_id and self.affinity_max_load is not None:
            instance = session_instance(session_id, candidates, self.affinity_max_load)
            if instance is not None:
                self.metrics.on_decision(self.policy, "affinity", time.perf_counter() - start, None)
                return instance
        if isinstance(self.router, CacheAwareRouter):
            d = self.router.decide(request_tokens, candidates)
            self.metrics.on_decision(self.policy, d.reason, time.perf_counter() - start, d.overlap)
            return d.instance_id
        instance = self.router.route(request_tokens, candidates)
        outcome = _OUTCOME.get(self.policy, self.policy)
        self.metrics.on_decision(self.policy, outcome, time.perf_counter() - start, None)
        return instance
