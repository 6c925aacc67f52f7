"""Engine: the one engine loop. Both the offline LLM and the scheduler service drive it with step().

With overlap scheduling (GPU), step() plans and launches batch N+1 before it reads back batch N's tokens,
so the host's bookkeeping hides behind the device's work; without it, each step is launch-then-read. A batch
with grammar-constrained rows launches its forward, and samples once the host has accepted batch N's tokens
into the matchers and filled those rows' token bitmask (while the device ran the forward).
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist

from kubesgl import env
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.distributed import check_ranks, init_tp, local_ranks, rank0_store, spawn_ranks
from kubesgl.engine.grammar import EngineGrammars, has_tokenizer
from kubesgl.engine.plan import BatchPlan
from kubesgl.engine.request import Req
from kubesgl.engine.runner import ModelRunner
from kubesgl.engine.scheduler import Scheduler, SchedulerLimits
from kubesgl.engine.step_log import StepLog
from kubesgl.engine.step_profile import StepHook, StepProfile
from kubesgl.engine.step_result import PendingSample, StepResult
from kubesgl.errors import InvalidRequestError
from kubesgl.kv.kv_events import KVEvents
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import NaiveCache, PrefixCache
from kubesgl.kv.radix import RadixCache
from kubesgl.structured.matcher import TokenBitmask
from kubesgl.values.outputs import EngineStats, ModelInfo, RequestOutput
from kubesgl.values.sampling import SamplingParams

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

# A launched batch: its plan, its requests (one per row) and its results (or its sampling, still to come).
Launched = tuple[BatchPlan, list[Req], StepResult | PendingSample]
_GRAMMAR_IDLE_WAIT_S = 0.005  # nothing to run but grammars compiling: wait this long for one, then step again


def overlap_enabled(config: EngineConfig) -> bool:
    return config.device == "cuda" and not config.disable_overlap and not env.disable_overlap_scheduling()


class Engine:
    def __init__(self, config: EngineConfig, step_hook: StepHook | None = None) -> None:
        started = time.perf_counter()
        config.validate()
        check_ranks(config)
        if config.node_rank != 0:
            raise InvalidRequestError("only node 0 runs the engine; other nodes use run_node_ranks")
        if step_hook is None and env.step_profile() and env.step_log():  # one hook: neither may go unheard
            raise InvalidRequestError(
                "KUBESGL_STEP_PROFILE and KUBESGL_STEP_LOG are both set; set one of them"
            )
        self.config = config
        store = rank0_store(config)
        port = store.port if store is not None else 0
        # This node's other ranks; the other nodes start theirs themselves (run_node_ranks).
        self._workers: list[BaseProcess] = spawn_ranks(local_ranks(config)[1:], config, port)
        self.tp = init_tp(0, config, port, store)
        try:
            self.runner = ModelRunner(config, self.tp)
        except BaseException:
            self.shutdown()
            raise
        r = self.runner
        self.pool = PagePool(r.num_pages, config.page_size)
        self.kv_events = KVEvents(config.kv_event_block_size) if config.kv_event_block_size > 0 else None
        cache: PrefixCache = (
            RadixCache(config.page_size, self.pool, self.kv_events)
            if config.cache == "radix"
            else NaiveCache(config.page_size, self.pool)
        )
        self.grammars = (
            EngineGrammars(
                config.model_path, r.model.vocab_size, r.model.eos_token_ids, config.bound_json_values
            )
            if has_tokenizer(config.model_path)
            else None
        )
        self._bitmask: TokenBitmask | None = None  # made on the first constrained step
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_running_requests=config.max_running_requests,
                max_prefill_tokens=config.max_prefill_tokens,
                context_len=r.context_len,
                vocab_size=r.model.vocab_size,
                eos_token_ids=tuple(r.model.eos_token_ids),
                default_max_tokens=config.default_max_tokens,
                enable_mixed_chunk=config.enable_mixed_chunk,
            ),
            self.pool,
            cache,
            seed=config.seed,
            grammars=self.grammars,
        )
        self.cache = cache
        self.overlap = overlap_enabled(config)
        self._inflight: Launched | None = None
        if step_hook is None and env.step_profile():
            step_hook = StepProfile(on_cuda=self.runner.device.type == "cuda")
        elif step_hook is None and (log_path := env.step_log()):
            step_hook = StepLog(log_path, self.scheduler, self.pool, self.cache)
        self.step_hook = step_hook  # called at each phase of step() (profiling); None costs nothing
        hf = r.model.hf_config
        self.info = ModelInfo(
            name=os.path.basename(os.path.normpath(config.model_path)),
            architecture=(getattr(hf, "architectures", None) or ["?"])[0],
            context_len=r.context_len,
            vocab_size=r.model.vocab_size,
            eos_token_ids=tuple(r.model.eos_token_ids),
            page_size=config.page_size,
            num_pages=self.pool.capacity,
            load_weights_s=r.load_weights_s,
            startup_s=time.perf_counter() - started,
        )

    # -- the driver's interface ---------------------------------------------------------------------
    def add_request(
        self, rid: str, input_ids: list[int], params: SamplingParams, output_ids: Sequence[int] = ()
    ) -> None:
        """The engine's gate: raises InvalidRequestError (or ContextLengthError) for a request it cannot run.
        `output_ids`: the request's first output tokens, already generated (a resumed request: Admission.add)."""
        self.scheduler.add_request(rid, input_ids, params, output_ids)

    def abort(self, rid: str) -> None:
        self.scheduler.abort(rid)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._inflight is not None

    def step(self) -> list[RequestOutput]:
        hook = self.step_hook
        if hook is not None:
            hook.step_started()
        outputs: list[RequestOutput] = []
        scheduled = self.scheduler.schedule()
        launched = None
        if scheduled is not None:
            plan, reqs = scheduled
            if hook is not None:
                hook.scheduled(plan)
            self.tp.broadcast_object(plan)
            launched = (plan, reqs, self.runner.execute(plan))
            if hook is not None:
                hook.launched(plan)
        if self.overlap:
            done, self._inflight = self._inflight, launched
            if done is not None:
                outputs += self._process(*done)
            # After batch N's tokens reached the matchers: batch N+1's grammar rows can be masked.
            self._inflight = self._sample_pending(self._inflight)
        elif (sampled := self._sample_pending(launched)) is not None:
            outputs += self._process(*sampled)
        outputs += self.scheduler.drain_finished()
        if scheduled is None and self._inflight is None and (grammar := self.scheduler.grammar_pending()):
            concurrent.futures.wait([grammar], timeout=_GRAMMAR_IDLE_WAIT_S)
        return outputs

    def _process(
        self, plan: BatchPlan, reqs: list[Req], result: StepResult | PendingSample
    ) -> list[RequestOutput]:
        assert isinstance(result, StepResult)
        host = result.to_host()
        hook = self.step_hook
        if hook is not None:
            hook.read_back(plan)
        outputs = self.scheduler.process(plan, reqs, host)
        if hook is not None:
            hook.processed(plan)
        return outputs

    def _sample_pending(self, launched: Launched | None) -> Launched | None:
        """A launched batch whose grammar rows wait for their bitmask: filled from the matchers now, then
        sampled (the other ranks receive the same bitmask)."""
        if launched is None or not isinstance(launched[2], PendingSample):
            return launched
        plan, reqs, pending = launched
        if self._bitmask is None:
            cfg = self.config
            self._bitmask = TokenBitmask(
                cfg.max_running_requests, self.runner.model.vocab_size, self.runner.device
            )
        states = self.scheduler.grammar_states(plan, reqs)
        self._bitmask.fill(states)
        return plan, reqs, self.runner.sample_masked(pending, self._bitmask.upload(len(states)))

    def flush_cache(self) -> int:
        """Drops every prefix the cache holds that no request uses (SGLang's flush_cache): the next prompts
        find nothing cached. Returns the pages freed."""
        return self.cache.evict(self.cache.evictable_pages)

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        """Block hashes the prefix cache stored and removed since the last call (empty when events are off)."""
        return self.kv_events.drain() if self.kv_events is not None else ([], [])

    def stats(self) -> EngineStats:
        s, n = self.scheduler, self.scheduler.counters
        return EngineStats(
            num_running=len(s.running),
            num_queued=len(s.waiting),
            free_pages=self.pool.num_free,
            available_pages=self.pool.num_free + self.cache.evictable_pages,
            total_pages=self.pool.capacity,
            cached_prefix_pages=self.cache.cached_pages,
            prompt_tokens_total=n.prompt_tokens,
            cached_tokens_total=n.cached_tokens,
            generation_tokens_total=n.generation_tokens,
            retracted_total=n.preemptions,
            pending_prefill_tokens=s.pending_prefill_tokens(),
        )

    def shutdown(self) -> None:
        if self.tp.size > 1 and dist.is_initialized():
            try:
                self.tp.broadcast_object(None)
            finally:
                dist.destroy_process_group()
        for p in self._workers:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        self._workers = []
        if getattr(self, "grammars", None) is not None:
            self.grammars.close()
        runner = getattr(self, "runner", None)  # absent when the runner itself failed to start
        if runner is not None:
            runner.release_device_memory()
