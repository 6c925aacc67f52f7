"""The scheduler's prefill backlog in tokens (EngineStats.pending_prefill_tokens, the gauge
kubesgl_scheduler_pending_prefill_tokens): what a prefill instance's autoscaler reads."""

from __future__ import annotations

from kubesgl import SamplingParams
from kubesgl.engine.plan import StepTokens
from kubesgl.engine.scheduler import Scheduler, SchedulerLimits
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.radix import RadixCache

GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def _scheduler(budget: int = 16, page_size: int = 4) -> Scheduler:
    limits = SchedulerLimits(
        max_running_requests=8, max_prefill_tokens=budget, context_len=512, vocab_size=500, eos_token_ids=(0,)
    )
    pool = PagePool(200, page_size)
    return Scheduler(limits, pool, RadixCache(page_size, pool))


def _step(s: Scheduler) -> None:
    plan, reqs = s.schedule()
    s.process(plan, reqs, StepTokens([7 if x else -1 for x in plan.sample], [None] * plan.batch_size))


def test_queued_prompts_then_the_rest_of_a_chunked_prefill_count_until_it_is_done() -> None:
    s = _scheduler(budget=16)
    assert s.pending_prefill_tokens() == 0
    s.add_request("long", list(range(1, 41)), GREEDY)  # 40 tokens: three chunks of at most 16
    s.add_request("short", list(range(1, 11)), GREEDY)
    assert s.pending_prefill_tokens() == 50
    _step(s)  # the first 16 of "long"
    assert s.pending_prefill_tokens() == 24 + 10
    _step(s)
    assert s.pending_prefill_tokens() == 8 + 10
    _step(s)  # "long" done, "short" started in the chunk's leftover budget
    assert s.pending_prefill_tokens() == 2
    _step(s)
    assert s.pending_prefill_tokens() == 0
    # Decoding adds nothing; a new arrival counts its whole prompt again.
    _step(s)
    s.add_request("next", list(range(1, 7)), GREEDY)
    assert s.pending_prefill_tokens() == 6
