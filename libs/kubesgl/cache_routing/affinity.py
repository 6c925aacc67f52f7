"""Session affinity: the same session id goes to the same live instance (rendezvous hashing), so adding or
losing an instance moves only the sessions that were on it."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from kubesgl.cache_routing.load import instance_load
from kubesgl.routing import Candidate


def rendezvous_weight(session_id: str, instance_id: str) -> int:
    digest = hashlib.blake2b(f"{session_id}\0{instance_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def session_instance(session_id: str, candidates: Sequence[Candidate], max_load: float) -> str | None:
    """The session's instance among `candidates`, or None when that one is at `max_load` or above (then the
    routing policy decides, rather than piling a hot session onto a full instance)."""
    if not candidates:
        return None
    top = max(candidates, key=lambda c: rendezvous_weight(session_id, c.instance_id))
    return top.instance_id if instance_load(top) < max_load else None
