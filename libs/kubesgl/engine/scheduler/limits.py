"""What the scheduler may spend per step and per request, and the counters it keeps for the engine's stats."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerLimits:
    max_running_requests: int
    max_prefill_tokens: int
    context_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    default_max_tokens: int | None = None  # budget of a request without max_tokens (None: the whole context)
    enable_mixed_chunk: bool = False  # prefill steps carry the decode batch (SGLang's --enable-mixed-chunk)


@dataclass
class SchedulerCounters:
    """Totals since start (EngineStats and `kubesgl bench offline` read them)."""

    prompt_tokens: int = 0  # of requests at their first admission
    cached_tokens: int = 0  # prefix-cache hits at first admission
    generation_tokens: int = 0
    preemptions: int = 0
    steps: Counter[str] = field(default_factory=Counter)  # planned steps by kind: extend, mixed, decode
    mixed_decode_rows: int = 0  # decode rows that rode in mixed steps
