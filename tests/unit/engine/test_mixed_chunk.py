"""Mixed chunks (`enable_mixed_chunk`, SGLang's `--enable-mixed-chunk`): a prefill step carries the decode batch.

The scheduler's plan layout and budget are checked on their own; then the engine, with mixing on and off, must
produce the same tokens: greedy under chunked prefill, prefix hits, page sizes 1 and 16, preemption and TP=2;
seeded sampling, penalties, filters, logprobs and stop ids in the mixed step's decode rows; aborts of rows
of a step in flight; overlap scheduling; each CPU attention backend. The `gpu` tests repeat the parity on
the device's backends (FlashInfer, Triton, FlashInfer prefill + Triton decode) with graphs and overlap on.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import NamedTuple

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.cli import build_parser
from kubesgl.engine.plan import BatchPlan, StepTokens
from kubesgl.engine.scheduler import Scheduler, SchedulerLimits
from kubesgl.kv.page_pool import PagePool
from kubesgl.kv.radix import RadixCache
from kubesgl.models.random_init import build_random_model
from kubesgl.services.scheduler.app import engine_config
from kubesgl.values.sampling import LogprobOptions
from support.engine_helpers import assert_greedy_match, hf_top_logits
from support.numerics import bf16_tie, logprob_tolerance

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


# --- the scheduler's plans ------------------------------------------------------------------------------


def _scheduler(mixed: bool = True, budget: int = 32, pages: int = 200, page_size: int = 4) -> Scheduler:
    limits = SchedulerLimits(
        max_running_requests=8,
        max_prefill_tokens=budget,
        context_len=512,
        vocab_size=500,
        eos_token_ids=(0,),
        enable_mixed_chunk=mixed,
    )
    pool = PagePool(pages, page_size)
    return Scheduler(limits, pool, RadixCache(page_size, pool))


def _run(s: Scheduler) -> BatchPlan:
    """Schedules one step and applies it at once (token 7 for every sampled row)."""
    plan, reqs = s.schedule()
    s.process(plan, reqs, StepTokens([7 if x else -1 for x in plan.sample], [None] * plan.batch_size))
    return plan


def _decoding(s: Scheduler, n: int, length: int = 5) -> None:
    """n requests past their prefill (each sampled its first token), prefilled in one step."""
    for i in range(n):
        s.add_request(f"d{i}", _prompt(length, i), GREEDY)
    plan = _run(s)
    assert plan.mode == "extend" and plan.num_decode == 0 and plan.batch_size == n


def test_mixed_step_carries_every_decoder_after_the_prefill_rows() -> None:
    s = _scheduler()
    _decoding(s, 3)
    kv = {r.rid: r.kv_len for r in s.running}
    s.add_request("long", _prompt(50, 9), GREEDY)  # 50 tokens against a budget of 32 - 3 decode rows
    plan = _run(s)
    assert plan.mode == "extend" and plan.num_decode == 3 and plan.num_extend == 1
    assert plan.extend_lens == [29, 1, 1, 1]  # the chunk takes what the decode rows leave
    assert len(plan.tokens) == 29  # decode rows' tokens are in the token pool, not the plan
    assert plan.prefix_lens[1:] == [kv["d0"], kv["d1"], kv["d2"]]
    assert plan.sample == [False, True, True, True]
    assert s.counters.steps == {"extend": 1, "mixed": 1} and s.counters.mixed_decode_rows == 3
    plan = _run(s)  # the rest of the prompt, the decoders again
    assert plan.extend_lens == [21, 1, 1, 1] and plan.sample == [True, True, True, True]
    plan = _run(s)  # nothing left to prefill: a plain decode step, graph-eligible
    assert plan.mode == "decode" and plan.batch_size == 4


def test_without_the_flag_prefill_steps_stall_decoders() -> None:
    s = _scheduler(mixed=False)
    _decoding(s, 3)
    s.add_request("long", _prompt(50, 9), GREEDY)
    assert _run(s).extend_lens == [32]
    assert s.counters.steps == {"extend": 2}


def test_decoders_filling_the_budget_leave_the_step_unmixed() -> None:
    s = _scheduler(budget=4)
    _decoding(s, 4, length=1)
    s.add_request("late", _prompt(10, 9), GREEDY)
    plan = _run(s)
    assert plan.num_decode == 0 and plan.extend_lens == [4]  # 4 decode rows would use all 4 tokens
    s = _scheduler(budget=4)
    _decoding(s, 3, length=1)
    s.add_request("late", _prompt(10, 9), GREEDY)
    assert _run(s).extend_lens == [1, 1, 1, 1]  # 3 leave one token: the chunk crawls, decoders advance


def test_decode_pages_short_leave_the_plan_as_without_mixing() -> None:
    """Two decoders about to need a second page each, five pages free: unmixed, the 8-token chunk (2 pages) fits
    next to the admission headroom (2); mixed, a 6-token chunk (2) with the headroom and the decode rows' own
    pages (2) does not, so the step is planned as without mixing."""
    plans = []
    for mixed in (False, True):
        s = _scheduler(mixed=mixed, budget=8, pages=8, page_size=4)  # 7 usable pages
        _decoding(s, 2, length=4)  # one full page each
        assert s.pool.num_free == 5
        s.add_request("late", _prompt(20, 9), GREEDY)
        plan = _run(s)
        plans.append((plan.mode, plan.slots, plan.extend_lens, plan.num_decode))
    assert plans[1] == plans[0] == ("extend", [2], [8], 0)


def test_decoder_aborted_while_its_mixed_step_is_in_flight_drops_its_token() -> None:
    """Overlap scheduling's interleave: the step is planned, the request finishes, then the step's tokens come."""
    s = _scheduler()
    _decoding(s, 2)
    s.add_request("long", _prompt(40, 9), GREEDY)
    plan, reqs = s.schedule()
    assert plan.num_decode == 2
    s.abort("d0")
    s.abort("long")
    outs = s.process(plan, reqs, StepTokens([7 if x else -1 for x in plan.sample], [None] * plan.batch_size))
    assert {o.rid: (o.finished, len(o.new_token_ids)) for o in outs} == {
        "d1": (False, 1),
        "d0": (True, 0),
        "long": (True, 0),
    }
    assert [r.rid for r in s.running] == ["d1"]
    s.abort("d1")
    assert s.pool.num_free + s.cache.evictable_pages == s.pool.capacity


def test_sglang_flag_reaches_the_engine_and_the_benchmark() -> None:
    def parse(*flags: str) -> tuple[bool, bool]:
        sched = engine_config(build_parser("scheduler").parse_args(["scheduler", "--model", "/m", *flags]))
        bench = build_parser("bench").parse_args(["bench", "offline", *flags])
        return sched.enable_mixed_chunk, bench.enable_mixed_chunk

    assert parse() == (False, False)  # off until the device says otherwise (docs/performance.md)
    assert parse("--enable-mixed-chunk") == (True, True)
    assert parse("--enable-mixed-chunk", "--no-enable-mixed-chunk") == (False, False)


# --- the engine, mixing on and off ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_random_model("qwen3", tmp_path_factory.mktemp("m") / "qwen3", init_std=0.5))


class PlanLog:
    """A StepHook that keeps every plan the engine launched."""

    def __init__(self) -> None:
        self.plans: list[BatchPlan] = []

    def step_started(self) -> None: ...

    def scheduled(self, plan: BatchPlan) -> None:
        self.plans.append(plan)

    def launched(self, plan: BatchPlan) -> None: ...

    def read_back(self, plan: BatchPlan) -> None: ...

    def processed(self, plan: BatchPlan) -> None: ...


def _workload() -> list[list[int]]:
    """Prompts of 4-70 tokens; every third one shares a 40-token prefix (prefix-cache hits at admission)."""
    shared = _prompt(40, 100)
    return [(shared if i % 3 == 0 else []) + _prompt(4 + 5 * i, i) for i in range(12)]


class Run(NamedTuple):
    outs: list[dict]
    plans: list[BatchPlan]
    preemptions: int
    overlap: bool
    graphs: bool

    @property
    def mixed(self) -> list[BatchPlan]:
        return [p for p in self.plans if p.num_decode]


def _generate(
    model: str,
    params: SamplingParams | list[SamplingParams],
    mixed: bool,
    overlap: bool = False,
    prompts: int = 12,
    **config: object,
) -> Run:
    """Four running requests at most, so later prompts are prefilled while earlier ones decode."""
    cfg = {"max_running_requests": 4, "max_prefill_tokens": 48, **config, "enable_mixed_chunk": mixed}
    with LLM(model, **cfg) as llm:
        if overlap:  # the CPU runs each step synchronously: this drives only the scheduling interleave
            llm.engine.overlap = True
        log = PlanLog()
        llm.engine.step_hook = log
        outs = llm.generate(_workload()[:prompts], params)
        stats = llm.engine.stats()
        assert stats.available_pages == stats.total_pages and stats.num_running == stats.num_queued == 0
        graphs = llm.engine.runner.graphs is not None  # before shutdown, which drops the graphs
    return Run(outs, log.plans, stats.retracted_total, llm.engine.overlap, graphs)


def _tokens(run: Run) -> list[list[int]]:
    return [o["token_ids"] for o in run.outs]


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"page_size": 16},
        {"max_prefill_tokens": 20},  # long prompts chunked, decoders riding along each chunk
        {"max_prefill_tokens": 20, "page_size": 16},
        {"cache": "naive"},
        {"num_pages": 40, "page_size": 4},  # room for one or two requests: eviction and preemption
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()) or "defaults",
)
@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_greedy_tokens_equal_with_and_without_mixing(model: str, config: dict) -> None:
    off = _generate(model, GREEDY, mixed=False, **config)
    on = _generate(model, GREEDY, mixed=True, **config)
    assert _tokens(on) == _tokens(off)
    assert [o["cached_tokens"] for o in on.outs] == [o["cached_tokens"] for o in off.outs]
    assert on.mixed, "no step was mixed"
    budget = config.get("max_prefill_tokens", 48)
    for p in on.mixed:
        assert sum(p.extend_lens) <= budget and p.extend_lens[p.num_extend :] == [1] * p.num_decode
    if config.get("num_pages"):
        assert on.preemptions > 0
    if config.get("cache") != "naive":
        assert any(o["cached_tokens"] for o in on.outs)


@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_sampling_in_mixed_decode_rows_equals_the_decode_step(model: str) -> None:
    """Seeded noise is keyed by (seed, position, token), so the rows draw the same tokens in a mixed step as in
    a decode step; penalties read the same history; logprobs are of the same logits."""
    lp = LogprobOptions(top=3)
    greedy = _tokens(_generate(model, GREEDY, mixed=False))[4]
    stop = greedy[5]
    params = [
        SamplingParams(max_tokens=12, temperature=1.3, seed=11, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.9, seed=12, top_k=20, top_p=0.8, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=1.0, seed=13, min_p=0.05, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=(stop,), ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.8, seed=14, presence_penalty=0.7, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0.7, seed=15, frequency_penalty=0.5, logprobs=lp),
        SamplingParams(max_tokens=12, temperature=0, logprobs=lp, ignore_eos=True),
    ]
    params = (params + params)[:12]
    off = _generate(model, params, mixed=False)
    on = _generate(model, params, mixed=True)
    assert on.mixed
    assert off.outs[4]["finish_reason"] == "stop" and _tokens(off)[4] == greedy[: greedy.index(stop) + 1]
    for a, b in zip(on.outs, off.outs, strict=True):
        assert (a["token_ids"], a["finish_reason"]) == (b["token_ids"], b["finish_reason"])
        if b["logprobs"] is not None:
            for x, y in zip(a["logprobs"], b["logprobs"], strict=True):
                assert x.token_id == y.token_id and [t for t, _ in x.top] == [t for t, _ in y.top]
                # A mixed step is another batch: other GEMM shapes, other rounding (context: >= the longest
                # prompt, 99 tokens, + 12).
                assert x.logprob == pytest.approx(y.logprob, rel=0, abs=logprob_tolerance(model, context=111))


def test_mixing_under_overlap_scheduling(model: str) -> None:
    """Planned one step ahead, a mixed step's decode rows include requests whose first token the host has not
    read yet (the token pool has it); the tokens are those of the synchronous loop."""
    off = _generate(model, GREEDY, mixed=False)
    on = _generate(model, GREEDY, mixed=True, overlap=True, max_prefill_tokens=20)
    assert _tokens(on) == _tokens(off)
    assert on.mixed


def test_abort_mid_mixed_steps_frees_everything(model: str) -> None:
    with LLM(model, page_size=4, max_prefill_tokens=16, enable_mixed_chunk=True) as llm:
        eng = llm.engine
        eng.overlap = True  # a step is in flight whenever the host aborts
        long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
        eng.add_request("dec", _prompt(10, 1), long)
        seen = eng.step()
        eng.add_request("chunked", _prompt(60, 2), long)  # 15-token chunks next to the decoder
        eng.add_request("other", _prompt(8, 3), long)
        for _ in range(2):
            seen += eng.step()
        assert eng.scheduler.counters.steps["mixed"] == 2
        eng.abort("dec")
        eng.abort("chunked")  # mid-prefill
        while eng.has_work():
            seen += eng.step()
        finals = {o.rid: o.finish_reason for o in seen if o.finished}
        assert finals == {"dec": "abort", "chunked": "abort", "other": "length"}
        s = eng.stats()
        assert s.available_pages == s.total_pages and s.num_running == 0


@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_tp2_mixed_matches_tp1_unmixed(model: str) -> None:
    off = _generate(model, GREEDY, mixed=False, page_size=4)
    on = _generate(model, GREEDY, mixed=True, page_size=4, tp_size=2)
    assert _tokens(on) == _tokens(off)
    assert on.mixed


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests run Triton compiled")
@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_triton_backend_in_the_interpreter_equal_with_and_without_mixing(model: str) -> None:
    """The Triton extend kernel attends the mixed step's one-token decode rows (CPU: Triton's interpreter)."""
    params = replace(GREEDY, max_tokens=6)
    off = _generate(model, params, mixed=False, prompts=7, attn="triton", page_size=16)
    on = _generate(model, params, mixed=True, prompts=7, attn="triton", page_size=16)
    assert _tokens(on) == _tokens(off)
    assert on.mixed


# --- GPU: the device's backends, graphs and overlap on ------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _top_logits(model: str, prompts: list[list[int]], outputs: list[list[int]]) -> list[list[float]]:
    """Each output step's largest logit magnitude, from HF's float32 forward (support.numerics.bf16_tie)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).cuda().eval()
    return [hf_top_logits(hf, p, out) for p, out in zip(prompts, outputs, strict=True)]


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    overrides = {"hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 128}
    return str(
        build_random_model("qwen3", tmp_path_factory.mktemp("g") / "qwen3", overrides=overrides, init_std=0.5)
    )


def _gpu_generate(model: str, params: SamplingParams, mixed: bool, **config: object) -> Run:
    """Graphs and overlap on (the device defaults); 96-token chunks, so prompts of 40-100 tokens mix."""
    cfg = dict(device="cuda", page_size=16, num_pages=2048, max_running_requests=4, max_prefill_tokens=96)
    run = _generate(model, params, mixed, **{**cfg, **config})
    assert run.overlap and run.graphs
    return run


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attn", ["flashinfer", "triton", "flashinfer,triton"])
def test_gpu_greedy_equal_with_and_without_mixing(gpu_model: str, attn: str) -> None:
    if "flashinfer" in attn:
        pytest.importorskip("flashinfer")
    ref_params = replace(GREEDY, max_tokens=24, logprobs=LogprobOptions(top=2))
    ref = _gpu_generate(gpu_model, ref_params, mixed=False, attn=attn, dtype="bfloat16")
    on = _gpu_generate(gpu_model, replace(GREEDY, max_tokens=24), mixed=True, attn=attn, dtype="bfloat16")
    assert on.mixed
    tops = _top_logits(gpu_model, _workload(), [r["token_ids"] for r in ref.outs])
    for o, r, top in zip(on.outs, ref.outs, tops, strict=True):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in r["logprobs"]]
        assert_greedy_match(o["token_ids"], r["token_ids"], gaps, tie=[bf16_tie(z) for z in top])


@pytest.mark.gpu
@needs_cuda
def test_gpu_seeded_sampling_equal_with_and_without_mixing(gpu_model: str) -> None:
    """float32 Triton, so the two runs' logits differ only in rounding: the keyed noise picks the same tokens."""
    params = SamplingParams(max_tokens=24, temperature=1.2, seed=5, top_p=0.95, ignore_eos=True)
    off = _gpu_generate(gpu_model, params, mixed=False, attn="triton", dtype="float32")
    on = _gpu_generate(gpu_model, params, mixed=True, attn="triton", dtype="float32")
    assert on.mixed
    assert _tokens(on) == _tokens(off)
