"""Greedy parity with HF transformers on identical random weights, for each model family and engine config."""

from __future__ import annotations

import random

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.models.random_init import build_random_model
from support.engine_helpers import assert_greedy_match, hf_greedy
from support.model_helpers import PARITY_ARCHS
from support.numerics import logits_tolerance
from transformers import AutoModelForCausalLM

N_NEW = 12


def _prompts(n: int, seed: int, vocab: int = 500) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randint(3, 40))] for _ in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {a: str(build_random_model(a, root / a, init_std=0.5)) for a in PARITY_ARCHS}


@pytest.fixture(scope="module")
def references(models: dict[str, str]) -> dict[str, list[tuple[list[int], list[int], list[float]]]]:
    refs = {}
    for arch, path in models.items():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        refs[arch] = [(p, *hf_greedy(hf, p, N_NEW)) for p in _prompts(16, seed=1)]
    return refs


def _check(llm: LLM, refs: list[tuple[list[int], list[int], list[float]]], model: str) -> None:
    prompts = [p for p, _, _ in refs]
    outs = llm.generate(prompts, SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True))
    tie = 2 * logits_tolerance(model, context=max(map(len, prompts)) + N_NEW)
    for (_, ref, gaps), out in zip(refs, outs, strict=True):
        assert out["finish_reason"] == "length"
        assert_greedy_match(out["token_ids"], ref, gaps, tie)


@pytest.mark.parametrize("arch", PARITY_ARCHS)
def test_greedy_matches_hf(arch: str, models: dict[str, str], references: dict) -> None:
    with LLM(models[arch]) as llm:
        _check(llm, references[arch], models[arch])


@pytest.mark.parametrize(
    "config",
    [
        {"cache": "naive"},
        {"cache": "radix", "page_size": 16},
        {"cache": "naive", "page_size": 16},
        {"max_prefill_tokens": 7},  # every prompt is chunked
        {"max_prefill_tokens": 7, "page_size": 16},
        {"max_running_requests": 1},  # batch 1
    ],
    ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()),
)
@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_greedy_matches_hf_under_engine_configs(
    arch: str, config: dict, models: dict, references: dict
) -> None:
    with LLM(models[arch], **config) as llm:
        _check(llm, references[arch], models[arch])


@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_batch_of_one_equals_batch_of_sixteen(models: dict[str, str]) -> None:
    prompts = _prompts(16, seed=7)
    sp = SamplingParams(max_tokens=N_NEW, temperature=0, ignore_eos=True)
    with LLM(models["qwen3"]) as llm:
        together = [o["token_ids"] for o in llm.generate(prompts, sp)]
        alone = [llm.generate([p], sp)[0]["token_ids"] for p in prompts]
    assert together == alone


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
@pytest.mark.slow  # 10-35 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_tp2_matches_tp1(arch: str, models: dict[str, str], references: dict) -> None:
    with LLM(models[arch], tp_size=2, page_size=4) as llm:
        _check(llm, references[arch], models[arch])
