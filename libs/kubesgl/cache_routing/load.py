"""How full a scheduler instance is, on its tighter resource, as routers compare instances."""

from __future__ import annotations

from kubesgl.routing import Candidate


def instance_load(c: Candidate) -> float:
    """max(requests / max_running_requests, share of KV pages not available): 1.0 is full, above it queues."""
    hb = c.heartbeat
    requests = c.load / max(hb.max_running_requests, 1)
    kv = 1.0 - hb.available_pages / hb.num_pages if hb.num_pages > 0 else 0.0
    return max(requests, kv)
