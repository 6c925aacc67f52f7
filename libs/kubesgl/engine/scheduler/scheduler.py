"""The Scheduler: continuous batching on the host, wired from its rooms (admission, planner, memory, outputs).
Pure bookkeeping; the runner does the math."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future

from kubesgl.engine.grammar import EngineGrammars
from kubesgl.engine.plan import BatchPlan, StepTokens
from kubesgl.engine.request import Req, ReqState
from kubesgl.engine.scheduler.admission import Admission
from kubesgl.engine.scheduler.limits import SchedulerCounters, SchedulerLimits
from kubesgl.engine.scheduler.memory import Memory
from kubesgl.engine.scheduler.outputs import HandedOff, Outputs
from kubesgl.engine.scheduler.planner import Planner, Scheduled, grammar_states
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import PrefixCache
from kubesgl.structured.compiler import CompiledConstraint
from kubesgl.structured.matcher import GrammarState
from kubesgl.values.outputs import FinishReason, RequestOutput
from kubesgl.values.sampling import SamplingParams


class Scheduler:
    def __init__(
        self,
        limits: SchedulerLimits,
        pool: PagePool,
        cache: PrefixCache,
        seed: int = 0,
        grammars: EngineGrammars | None = None,  # None: the model has no tokenizer, constraints are refused
    ) -> None:
        self.limits = limits
        self.pool = pool
        self.cache = cache
        self.counters = SchedulerCounters()
        self.reqs: dict[str, Req] = {}  # every request not yet reported finished
        self.admission = Admission(limits, pool.capacity * pool.page_size, self.reqs, grammars, seed)
        self.memory = Memory(pool, cache, limits.max_running_requests, self.counters)
        self.outputs = Outputs(limits, self.memory, self.reqs, self.counters)
        self.planner = Planner(limits, self.admission, self.memory, self.outputs)

    @property
    def waiting(self) -> deque[Req]:
        return self.admission.waiting

    @property
    def running(self) -> list[Req]:
        return self.memory.running

    # -- requests in and out -----------------------------------------------------------------------
    def add_request(
        self,
        rid: str,
        input_ids: list[int],
        params: SamplingParams,
        output_ids: Sequence[int] = (),
        hand_off: bool = False,
    ) -> None:
        self.admission.add(rid, input_ids, params, output_ids, hand_off)

    def take_handed_off(self) -> list[HandedOff]:
        """Prefill-role requests that got their first token since the last call (their KV locked for transfer)."""
        out, self.outputs.handed_off = self.outputs.handed_off, []
        return out

    def abort(self, rid: str) -> None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return
        if req.state is ReqState.WAITING:
            self.admission.waiting.remove(req)
        self.outputs.finish(req, FinishReason.ABORT)

    def pending_prefill_tokens(self) -> int:
        """Tokens still to prefill: every queued request's known ones (before any prefix-cache hit, found only at
        admission) and what running requests have left of a chunked prefill. A prefill instance scales on it."""
        queued = sum(r.num_known for r in self.admission.waiting)
        return queued + sum(r.prefill_target - r.kv_len for r in self.memory.running if r.is_prefilling)

    def has_work(self) -> bool:
        return bool(self.admission.waiting or self.memory.running or self.outputs.has_unreported)

    # -- one step ----------------------------------------------------------------------------------
    def schedule(self) -> Scheduled | None:
        """The next batch: prefill work first (chunked requests, then the queue), else one decode step for all.
        With mixed chunks on, a prefill step also carries every decode-ready request, one token each."""
        for req in self.admission.resolve_grammars():
            self.outputs.finish(req, FinishReason.ABORT)
        decoding = self.planner.decode_ready()
        prefill = self.planner.prefill_ready()
        scheduled = None
        if prefill and self.limits.enable_mixed_chunk and decoding:
            scheduled = self.planner.extend(prefill, decoding)
        # Without mixing, or when the decode rows leave no budget or memory for any prefill: as without the flag
        # (the decode step after it is where memory pressure preempts).
        if prefill and scheduled is None:
            scheduled = self.planner.extend(prefill, [])
        scheduled = scheduled or self.planner.decode(decoding)
        if scheduled is None:
            return None
        plan = scheduled[0]
        self.counters.steps["mixed" if plan.num_decode else plan.mode] += 1
        self.counters.mixed_decode_rows += plan.num_decode
        # Page-table rows changed by the prefix cache go first: the plan's own writes may extend them.
        plan.page_writes[:0] = self.memory.take_page_writes()
        return scheduled

    def process(self, plan: BatchPlan, reqs: list[Req], out: StepTokens) -> list[RequestOutput]:
        """Applies a finished step's sampled tokens; returns the outputs it produced (incl. aborts)."""
        return self.outputs.process(plan, reqs, out)

    def drain_finished(self) -> list[RequestOutput]:
        """Outputs of requests finished outside a step (aborts)."""
        return self.outputs.drain_finished()

    def grammar_pending(self) -> Future[CompiledConstraint] | None:
        """A grammar some queued request waits for (the engine idles on it when nothing else can run)."""
        return self.admission.grammar_pending()

    @staticmethod
    def grammar_states(plan: BatchPlan, reqs: list[Req]) -> list[GrammarState | None]:
        """The matchers of the plan's grammar rows, in order (None: the request finished meanwhile)."""
        return grammar_states(plan, reqs)
