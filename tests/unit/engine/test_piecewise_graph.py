"""Piecewise prefill graphs (engine/piecewise_graph.py): the forward cut at its attention kernels.

On CPU the piecewise path runs its pieces op by op over the same static buffers, padding and scratch slot
as the graphs replay them (PrefillGraphs without a GPU), and must give the tokens and logprobs of the plain
forward; on CUDA (`gpu`) the captured graphs are checked against an engine without them.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.engine.config import EngineConfig
from kubesgl.engine.piecewise_graph import (
    PrefillGraphs,
    auto_max_tokens,
    piecewise_applies,
    token_buckets,
)
from kubesgl.errors import InvalidRequestError
from kubesgl.kernels.fused_moe import experts_forward
from kubesgl.models.random_init import build_random_model
from kubesgl.values.sampling import LogprobOptions
from support.engine_helpers import assert_greedy_match
from support.numerics import logits_tolerance, logprob_tolerance

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_token_buckets_cover_every_size_with_bounded_padding() -> None:
    for top in (1, 16, 100, 256, 4096, 8192, 10000):
        sizes = token_buckets(top)
        assert sizes == sorted(set(sizes)) and sizes[-1] == top
        for t in range(1, top + 1, 7):
            b = next(s for s in sizes if s >= t)
            # Small steps (host-bound) pad to a power of two, large ones by at most a quarter or 64 tokens.
            assert b <= max(16, 2 * t) if t <= 256 else b - t <= max(64, t // 4), (top, t, b)
    assert token_buckets(8192)[:5] == [16, 32, 64, 128, 256]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(500) for _ in range(rng.randint(5, 90))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_pieces_over_static_buffers_give_the_forwards_tokens(tmp_path: Path, arch: str) -> None:
    """Chunked prefill (40-token steps, then a 22-token one padded to its 32-token bucket and carrying decode
    rows) through the pieces, against the plain forward: same greedy tokens up to a near-tie, logprobs within
    float32 rounding."""
    model = str(build_random_model(arch, tmp_path / arch, init_std=0.5))
    prompts = _prompts(10, seed=2)
    # Prompt logprobs too: they are read from the pieces' static hidden states within the step.
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=LogprobOptions(2, 0))
    cfg = dict(page_size=4, max_prefill_tokens=40, enable_mixed_chunk=True)
    with LLM(model, **cfg) as llm:
        ref = llm.generate(prompts, params)
    with LLM(model, **cfg) as llm:
        runner = llm.engine.runner
        # What a GPU engine captures without the flag: the prefill chunk, at most AUTO_MAX_TOKENS.
        assert auto_max_tokens(runner.model, 40) == 40 and auto_max_tokens(runner.model, 32768) == 8192
        graphs = PrefillGraphs(
            model=runner.model, attn=runner.attn, kv=runner.kv, max_tokens=40, device=runner.device
        )
        runner.prefill_graphs = graphs
        used: list[int] = []
        run = graphs.run
        graphs.run = lambda fb, size: used.append(size) or run(fb, size)  # type: ignore[method-assign]
        got = llm.generate(prompts, params)
    assert graphs.sizes == [16, 32, 40] and used == [40] * 11 + [32]
    assert graphs.bucket(41) is None and graphs.bucket(17) == 32  # larger steps run eager
    context = max(map(len, prompts)) + 6
    tie = 2 * logits_tolerance(model, context)
    tol = logprob_tolerance(model, context)
    for o, r in zip(got, ref, strict=True):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in r["logprobs"]]
        assert_greedy_match(o["token_ids"], r["token_ids"], gaps, tie)
        for a, b in zip(o["logprobs"], r["logprobs"], strict=False):
            if a.token_id == b.token_id:
                assert abs(a.logprob - b.logprob) <= tol
        prompt = o["prompt_logprobs"]
        assert [e.token_id for e in prompt] == [e.token_id for e in r["prompt_logprobs"]]
        for a, b in zip(prompt[1:], r["prompt_logprobs"][1:], strict=True):
            assert abs(a.logprob - b.logprob) <= tol


def test_padded_tokens_write_only_the_scratch_page(tmp_path: Path) -> None:
    """A step of 5 tokens in a 16-token bucket after a step of 16 real ones: the stale slots of the longer step
    must not receive the padded tokens' K/V (they would overwrite a request's cache)."""
    model = str(build_random_model("qwen3", tmp_path / "q", init_std=0.5))
    with LLM(model, page_size=4) as llm:
        runner = llm.engine.runner
        graphs = PrefillGraphs(
            model=runner.model, attn=runner.attn, kv=runner.kv, max_tokens=16, device=runner.device
        )
        runner.prefill_graphs = graphs
        params = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([list(range(16))], params)
        k0 = runner.kv.k_flat(0).clone()
        llm.generate([list(range(100, 105))], params)
        assert graphs.out_loc[5:16].eq(0).all()
        changed = (runner.kv.k_flat(0) != k0).flatten(1).any(1).nonzero().flatten().tolist()
        page = runner.page_size
        # Only the new request's 5 slots and the scratch page 0 changed.
        assert len([s for s in changed if s >= page]) == 5, changed


def test_moe_pieces_give_the_forwards_tokens(tmp_path: Path) -> None:
    """Qwen3-MoE through the pieces (its experts between the projections of each piece) against the forward."""
    model = str(build_random_model("qwen3_moe", tmp_path / "moe", init_std=0.5))
    prompts = _prompts(4, seed=3)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=LogprobOptions(top=2))
    with LLM(model, page_size=4) as llm:
        ref = llm.generate(prompts, params)
    with LLM(model, page_size=4) as llm:
        r = llm.engine.runner
        assert piecewise_applies(r.model) is None and auto_max_tokens(r.model, 8192) == 0
        r.prefill_graphs = PrefillGraphs(model=r.model, attn=r.attn, kv=r.kv, max_tokens=512, device=r.device)
        got = llm.generate(prompts, params)
    tie = 2 * logits_tolerance(model, context=100)
    for o, ref_out in zip(got, ref, strict=True):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in ref_out["logprobs"]]
        assert_greedy_match(o["token_ids"], ref_out["token_ids"], gaps, tie)


def test_models_without_pieces_are_refused(tmp_path: Path) -> None:
    model = str(build_random_model("qwen3_moe", tmp_path / "moe"))
    with LLM(model) as llm:
        r = llm.engine.runner
        for layer in r.model.model.layers:
            layer.mlp.experts_impl = experts_forward  # the reference experts: host reads
        assert piecewise_applies(r.model) == "mixture-of-experts without the Triton experts kernel"
        with pytest.raises(ValueError, match="Triton experts kernel"):
            PrefillGraphs(model=r.model, attn=r.attn, kv=r.kv, max_tokens=16, device=r.device)
        r.model.model = torch.nn.Identity()
        assert piecewise_applies(r.model) == "Qwen3MoeForCausalLM is not a DecoderModel"


def test_negative_max_tokens_is_refused() -> None:
    with pytest.raises(InvalidRequestError, match="piecewise_cuda_graph_max_tokens"):
        EngineConfig(model_path="unused", piecewise_cuda_graph_max_tokens=-1).validate()


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def gpu_model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    arch = request.param
    return str(build_random_model(arch, tmp_path_factory.mktemp("pw") / arch, init_std=0.5))


def _gpu_generate(model: str, max_tokens: int, **config: object) -> list[dict]:
    cfg = dict(device="cuda", page_size=16, num_pages=1024, max_running_requests=32, max_prefill_tokens=256)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=LogprobOptions(top=2))
    with LLM(model, **{**cfg, **config, "piecewise_cuda_graph_max_tokens": max_tokens}) as llm:
        if max_tokens:
            assert llm.engine.runner.prefill_graphs is not None
        return llm.generate(_prompts(24, seed=5), params)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("attn", ["triton", "auto"])
def test_graphs_match_the_eager_prefill(gpu_model: str, attn: str) -> None:
    """float32: piecewise graphs (every 256-token chunk through them) against eager extend steps."""
    ref = _gpu_generate(gpu_model, 0, dtype="float32", attn=attn)
    ours = _gpu_generate(gpu_model, 256, dtype="float32", attn=attn)
    tie = 2 * logits_tolerance(gpu_model, context=100)
    for o, r in zip(ours, ref, strict=True):
        gaps = [lp.top[0][1] - lp.top[1][1] for lp in r["logprobs"]]
        assert_greedy_match(o["token_ids"], r["token_ids"], gaps, tie)
