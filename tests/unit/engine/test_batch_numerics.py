"""What the engine's prompt logprobs promise across batch shapes: the same batch twice gives the same bits;
a request scored alone and inside a batch agree within float32 rounding of the model's sums (the CPU BLAS picks
its GEMM kernel by row count, so they need not be bit-identical: tests/support/numerics.py)."""

from __future__ import annotations

import random

import pytest
from kubesgl import LLM, SamplingParams
from kubesgl.models.random_init import build_random_model
from kubesgl.values.sampling import LogprobOptions
from support.numerics import logprob_tolerance

SCORE = SamplingParams(max_tokens=0, logprobs=LogprobOptions(top=1, prompt_start=0))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_random_model("qwen3", tmp_path_factory.mktemp("m") / "qwen3", init_std=0.5))


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(500) for _ in range(n)] for n in (3, 17, 30, 9, 24)]


def _scores(llm: LLM, prompts: list[list[int]]) -> list[list[float]]:
    return [[e.logprob for e in out["prompt_logprobs"][1:]] for out in llm.generate(prompts, SCORE)]


def test_a_batch_scored_twice_gives_the_same_bits(model: str) -> None:
    prompts = _prompts()
    with LLM(model, cache="naive") as llm:
        assert _scores(llm, prompts) == _scores(llm, prompts)  # the same kernels on the same shapes


def test_alone_and_in_a_batch_agree_within_rounding(model: str) -> None:
    prompts = _prompts()
    with LLM(model, cache="naive") as llm:
        batched = _scores(llm, prompts)
        alone = [_scores(llm, [p])[0] for p in prompts]
    tol = logprob_tolerance(model, context=max(map(len, prompts)))
    for b, a in zip(batched, alone, strict=True):
        assert b == pytest.approx(a, rel=0, abs=tol)
    # The bound is no blanket: under 0.1 % of the values it compares (a wrong position or token moves them by
    # whole units).
    assert tol < 1e-3 * max(abs(x) for b in batched for x in b)
