"""Engine: the one engine loop. Both the offline LLM and the scheduler service drive it with step().

With overlap scheduling (GPU), step() plans and launches batch N+1 before it reads back batch N's tokens,
so the host's bookkeeping hides behind the device's work; without it, each step is launch-then-read. A batch
with grammar-constrained rows launches its forward, and samples once the host has accepted batch N's tokens
into the matchers and filled those rows' token bitmask (while the device ran the forward).
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import os
import time
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kubesgl.distributed import TPGroup
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.grammar import EngineGrammars, has_tokenizer
from kubesgl.engine.plan import BatchPlan
from kubesgl.engine.request import Req
from kubesgl.engine.runner import ModelRunner, PendingSample, StepResult
from kubesgl.engine.scheduler import Scheduler, SchedulerLimits
from kubesgl.engine.step_profile import StepHook, StepProfile
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

_DIST_TIMEOUT = datetime.timedelta(minutes=10)
# A launched batch: its plan, its requests (one per row) and its results (or its sampling, still to come).
Launched = tuple[BatchPlan, list[Req], StepResult | PendingSample]
_GRAMMAR_IDLE_WAIT_S = 0.005  # nothing to run but grammars compiling: wait this long for one, then step again


def _validate(config: EngineConfig) -> None:
    checks = [
        (config.tp_size >= 1, "tp_size must be >= 1"),
        (config.page_size >= 1, "page_size must be >= 1"),
        (config.cache in ("radix", "naive"), f"cache must be 'radix' or 'naive', got {config.cache!r}"),
        (config.max_running_requests >= 1, "max_running_requests must be >= 1"),
        (config.max_prefill_tokens >= 1, "max_prefill_tokens must be >= 1"),
        (config.device in ("cpu", "cuda"), f"device must be 'cpu' or 'cuda', got {config.device!r}"),
        (config.num_pages is None or config.num_pages >= 1, "num_pages must be >= 1"),
        (
            config.default_max_tokens is None or config.default_max_tokens >= 1,
            "default_max_tokens must be >= 1",
        ),
    ]
    for ok, why in checks:
        if not ok:
            raise InvalidRequestError(why)
    nodes = [
        (config.nnodes >= 1 and config.tp_size % config.nnodes == 0, "tp_size must be a multiple of nnodes"),
        (0 <= config.node_rank < config.nnodes, "node_rank must be in [0, nnodes)"),
        (
            config.nnodes == 1 or config.dist_init_addr.rpartition(":")[2].isdigit(),
            "nnodes > 1 needs dist_init_addr host:port",
        ),
    ]
    for ok, why in nodes:
        if not ok:
            raise InvalidRequestError(why)
    local = local_ranks(config)
    if config.device == "cuda" and torch.cuda.device_count() < len(local):
        raise InvalidRequestError(
            f"tp_size {config.tp_size} over {config.nnodes} node(s) needs {len(local)} GPUs"
        )


def local_ranks(config: EngineConfig) -> range:
    """The global TP ranks this node runs: tp_size // nnodes consecutive ones, node 0 first."""
    per_node = config.tp_size // max(config.nnodes, 1)
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def _store_address(config: EngineConfig, port: int) -> tuple[str, int]:
    """Where the ranks meet: several nodes at dist_init_addr (rank 0's node); one node on loopback at `port`."""
    if config.nnodes == 1:
        return "127.0.0.1", port
    host, _, number = config.dist_init_addr.rpartition(":")
    return host.strip("[]"), int(number)


def _rank0_store(config: EngineConfig) -> dist.TCPStore | None:
    """Rank 0's rendezvous store, listening before any other rank starts. One node without --dist-port: on a
    port the kernel picks, which the ranks rank 0 spawns are told (a "free" port passed by number could be
    taken during their imports)."""
    if config.tp_size == 1:
        return None
    host, port = _store_address(config, config.dist_port)
    return dist.TCPStore(
        host, port, config.tp_size, is_master=True, timeout=_DIST_TIMEOUT, wait_for_workers=False
    )


def _init_tp(rank: int, config: EngineConfig, port: int, store: dist.TCPStore | None = None) -> TPGroup:
    """Joins the group: rank 0 through its own store (_rank0_store), every other rank as that store's client."""
    if config.tp_size == 1:
        return TPGroup()
    backend = "nccl" if config.device == "cuda" else "gloo"
    local_rank = rank - local_ranks(config).start
    if config.device == "cuda":
        torch.cuda.set_device(local_rank)
    if store is None:
        host, port = _store_address(config, port)
        store = dist.TCPStore(host, port, config.tp_size, is_master=False, timeout=_DIST_TIMEOUT)
    dist.init_process_group(backend, store=store, rank=rank, world_size=config.tp_size, timeout=_DIST_TIMEOUT)
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_DIST_TIMEOUT) if backend != "gloo" else group
    return TPGroup(rank, config.tp_size, group, cpu_group, local_rank)


def _worker_main(rank: int, config: EngineConfig, port: int) -> None:
    """Ranks 1..N-1: execute every plan rank 0 broadcasts, until it sends None."""
    tp = _init_tp(rank, config, port)
    try:
        runner = ModelRunner(config, tp)
        while True:
            plan = tp.broadcast_object(None)
            if plan is None:
                break
            result = runner.execute(plan)  # type: ignore[arg-type]
            if isinstance(result, PendingSample):
                runner.sample_masked(result, None)  # rank 0 broadcasts the bitmask
    finally:
        dist.destroy_process_group()


def _spawn_ranks(ranks: range, config: EngineConfig, port: int) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")
    workers = []
    for rank in ranks:
        p = ctx.Process(target=_worker_main, args=(rank, config, port), daemon=True)
        p.start()
        workers.append(p)
    return workers


def run_node_ranks(config: EngineConfig) -> int:
    """A node other than 0 (node_rank > 0): runs its ranks, which execute rank 0's plans, until rank 0 shuts
    the group down (exit 0) or the group breaks (a rank or node died: non-zero, so the pod restarts)."""
    if config.node_rank == 0:
        raise InvalidRequestError("node 0 runs the engine (Engine), not run_node_ranks")
    _validate(config)
    ranks = local_ranks(config)
    workers = _spawn_ranks(ranks[1:], config, 0)
    try:
        _worker_main(ranks.start, config, 0)
    finally:
        for p in workers:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return max([0, *(abs(p.exitcode or 0) for p in workers)])


def overlap_enabled(config: EngineConfig) -> bool:
    off = os.environ.get(
        "KUBESGL_DISABLE_OVERLAP_SCHEDULING", os.environ.get("MINISGL_DISABLE_OVERLAP_SCHEDULING")
    )
    return config.device == "cuda" and not config.disable_overlap and off not in ("1", "true", "True")


class Engine:
    def __init__(self, config: EngineConfig, step_hook: StepHook | None = None) -> None:
        started = time.perf_counter()
        _validate(config)
        if config.node_rank != 0:
            raise InvalidRequestError("only node 0 runs the engine; other nodes use run_node_ranks")
        self.config = config
        store = _rank0_store(config)
        port = store.port if store is not None else 0
        # This node's other ranks; the other nodes start theirs themselves (run_node_ranks).
        self._workers: list[BaseProcess] = _spawn_ranks(local_ranks(config)[1:], config, port)
        self.tp = _init_tp(0, config, port, store)
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
            EngineGrammars(config.model_path, r.model.vocab_size, r.model.eos_token_ids)
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
        if step_hook is None and os.environ.get("KUBESGL_STEP_PROFILE", "") not in ("", "0"):
            step_hook = StepProfile(on_cuda=self.runner.device.type == "cuda")
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
    def add_request(self, rid: str, input_ids: list[int], params: SamplingParams) -> None:
        """The engine's gate: raises InvalidRequestError (or ContextLengthError) for a request it cannot run."""
        self.scheduler.add_request(rid, input_ids, params)

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
