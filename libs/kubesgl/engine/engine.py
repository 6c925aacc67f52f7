"""Engine: the one engine loop. Both the offline LLM and the scheduler service drive it with step().

With overlap scheduling (GPU), step() plans and launches batch N+1 before it reads back batch N's tokens,
so the host's bookkeeping hides behind the device's work; without it, each step is launch-then-read.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kubesgl.distributed import TPGroup
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.plan import BatchPlan
from kubesgl.engine.request import Req
from kubesgl.engine.runner import ModelRunner, StepResult
from kubesgl.engine.scheduler import Scheduler, SchedulerLimits
from kubesgl.engine.step_profile import StepHook, StepProfile
from kubesgl.errors import InvalidRequestError
from kubesgl.kv.kv_events import KVEvents
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.prefix_cache import NaiveCache, PrefixCache
from kubesgl.kv.radix import RadixCache
from kubesgl.values.outputs import EngineStats, ModelInfo, RequestOutput
from kubesgl.values.sampling import SamplingParams

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess

log = logging.getLogger(__name__)

_DIST_TIMEOUT = datetime.timedelta(minutes=10)


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
    if config.device == "cuda" and torch.cuda.device_count() < config.tp_size:
        raise InvalidRequestError(f"tp_size {config.tp_size} needs {config.tp_size} GPUs")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_tp(rank: int, config: EngineConfig, port: int) -> TPGroup:
    if config.tp_size == 1:
        return TPGroup()
    backend = "nccl" if config.device == "cuda" else "gloo"
    if config.device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group(
        backend,
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=config.tp_size,
        timeout=_DIST_TIMEOUT,
    )
    group = dist.group.WORLD
    cpu_group = dist.new_group(backend="gloo", timeout=_DIST_TIMEOUT) if backend != "gloo" else group
    return TPGroup(rank, config.tp_size, group, cpu_group)


def _worker_main(rank: int, config: EngineConfig, port: int) -> None:
    """Ranks 1..N-1: execute every plan rank 0 broadcasts, until it sends None."""
    tp = _init_tp(rank, config, port)
    try:
        runner = ModelRunner(config, tp)
        while True:
            plan = tp.broadcast_object(None)
            if plan is None:
                break
            runner.execute(plan)  # type: ignore[arg-type]
    finally:
        dist.destroy_process_group()


def overlap_enabled(config: EngineConfig) -> bool:
    off = os.environ.get(
        "KUBESGL_DISABLE_OVERLAP_SCHEDULING", os.environ.get("MINISGL_DISABLE_OVERLAP_SCHEDULING")
    )
    return config.device == "cuda" and not config.disable_overlap and off not in ("1", "true", "True")


class Engine:
    def __init__(self, config: EngineConfig, step_hook: StepHook | None = None) -> None:
        _validate(config)
        self.config = config
        self._workers: list[BaseProcess] = []
        port = config.dist_port or _free_port()
        if config.tp_size > 1:
            ctx = mp.get_context("spawn")
            for rank in range(1, config.tp_size):
                p = ctx.Process(target=_worker_main, args=(rank, config, port), daemon=True)
                p.start()
                self._workers.append(p)
        self.tp = _init_tp(0, config, port)
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
        self.scheduler = Scheduler(
            SchedulerLimits(
                max_running_requests=config.max_running_requests,
                max_prefill_tokens=config.max_prefill_tokens,
                context_len=r.context_len,
                vocab_size=r.model.vocab_size,
                eos_token_ids=tuple(r.model.eos_token_ids),
                default_max_tokens=config.default_max_tokens,
            ),
            self.pool,
            cache,
            seed=config.seed,
        )
        self.cache = cache
        self.overlap = overlap_enabled(config)
        self._inflight: tuple[BatchPlan, list[Req], StepResult] | None = None
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
        else:
            done = launched
        if done is not None:
            plan, reqs, result = done
            host = result.to_host()
            if hook is not None:
                hook.read_back(plan)
            outputs += self.scheduler.process(plan, reqs, host)
            if hook is not None:
                hook.processed(plan)
        outputs += self.scheduler.drain_finished()
        return outputs

    def drain_kv_events(self) -> tuple[list[int], list[int]]:
        """Block hashes the prefix cache stored and removed since the last call (empty when events are off)."""
        return self.kv_events.drain() if self.kv_events is not None else ([], [])

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_queued=len(s.waiting),
            free_pages=self.pool.num_free,
            available_pages=self.pool.num_free + self.cache.evictable_pages,
            total_pages=self.pool.capacity,
            cached_prefix_pages=self.cache.cached_pages,
            prompt_tokens_total=s.prompt_tokens_total,
            cached_tokens_total=s.cached_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
            extra={"num_preemptions": float(s.num_preemptions)},
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
