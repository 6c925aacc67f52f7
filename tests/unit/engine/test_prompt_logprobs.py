"""Prompt-token logprobs (LogprobOptions.prompt_start, SGLang's logprob_start_len): computed during prefill,
equal to transformers' log_softmax of the same checkpoint, across prefill chunks and prefix-cache hits."""

from __future__ import annotations

import random
from functools import cache

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.models.random_init import build_random_model
from kubesgl.values.sampling import LogprobOptions
from support.numerics import assert_topk_matches, logprob_tolerance


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_random_model("qwen3", tmp_path_factory.mktemp("m") / "qwen3", init_std=0.5))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


@cache
def _hf(model: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)


def _reference(model: str, ids: list[int]) -> torch.Tensor:
    """[len(ids), vocab]: row p is log P(next token | ids[: p + 1])."""
    with torch.no_grad():
        return torch.log_softmax(_hf(model)(torch.tensor([ids])).logits[0].float(), -1)


def _assert_matches(model: str, ids: list[int], start: int, entries: list, top: int) -> None:
    """Our engine and transformers sum in other orders: equal within float32 rounding (support.numerics)."""
    ref = _reference(model, ids)
    tol = logprob_tolerance(model, context=len(ids))
    assert [e.token_id for e in entries] == ids[start:]
    for pos, e in zip(range(start, len(ids)), entries, strict=True):
        if pos == 0:
            assert e.logprob is None and e.top == ()
            continue
        assert e.logprob == pytest.approx(float(ref[pos - 1, ids[pos]]), rel=0, abs=tol)
        assert_topk_matches([t for t, _ in e.top], ref[pos - 1], tol)


def test_prompt_logprobs_are_the_models_with_the_first_token_null(model: str) -> None:
    ids = _prompt(23, 1)
    with LLM(model) as llm:
        out = llm.generate([ids], SamplingParams(max_tokens=2, temperature=0, logprobs=LogprobOptions(2, 0)))[
            0
        ]
    _assert_matches(model, ids, 0, out["prompt_logprobs"], 2)
    assert len(out["token_ids"]) == 2 and len(out["logprobs"]) == 2


@pytest.mark.parametrize(
    ("mixed", "overlap"), [(False, False), (True, False), (True, True)], ids=["plain", "mixed", "overlap"]
)
def test_prompt_logprobs_span_chunks_and_cached_prefixes(model: str, mixed: bool, overlap: bool) -> None:
    """A 7-token prefill budget cuts the prompt into chunks; the shared prefix is in the cache beforehand,
    and a prompt_start past it lets the request reuse the pages before it (page size 4). With overlap (the
    GPU's loop, forced here on the CPU) each chunk is planned before the previous one's logprobs are read."""
    prefix = _prompt(20, 2)
    ids = prefix + _prompt(9, 3)
    with LLM(model, page_size=4, max_prefill_tokens=7, enable_mixed_chunk=mixed) as llm:
        llm.engine.overlap = overlap
        warm = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        llm.generate([prefix + _prompt(4, 4)], warm)
        # A decoding request alongside, so mixed steps happen.
        outs = llm.generate(
            [ids, ids, _prompt(5, 5)],
            [
                SamplingParams(max_tokens=1, temperature=0, logprobs=LogprobOptions(1, 0)),
                SamplingParams(max_tokens=1, temperature=0, logprobs=LogprobOptions(3, 13)),
                warm,
            ],
        )
    _assert_matches(model, ids, 0, outs[0]["prompt_logprobs"], 1)
    assert outs[0]["cached_tokens"] == 0  # a cached prefix has no logits: nothing before position 0 reused
    _assert_matches(model, ids, 13, outs[1]["prompt_logprobs"], 3)
    assert outs[1]["cached_tokens"] == 12  # matched up to the logits of position 12, in whole pages


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_max_tokens_0_returns_the_prompt_only(model: str, overlap: bool) -> None:
    ids = _prompt(11, 6)
    with LLM(model, max_prefill_tokens=4) as llm:
        llm.engine.overlap = overlap
        out = llm.generate([ids], SamplingParams(max_tokens=0, logprobs=LogprobOptions(0, 0)))[0]
        assert llm.engine.stats().num_running == 0
    assert out["token_ids"] == [] and out["finish_reason"] == "length"
    _assert_matches(model, ids, 0, out["prompt_logprobs"], 0)


@pytest.mark.parametrize("overlap", [False, True], ids=["serial", "overlap"])
def test_preempted_requests_keep_their_prompt_logprobs(model: str, overlap: bool) -> None:
    """Room for about two requests: half-prefilled ones are preempted and prefilled again; each prompt
    position is still scored exactly once, and the values are those of a roomy run."""
    prompts = [_prompt(30 + i, 20 + i) for i in range(8)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=LogprobOptions(1, 0))
    with LLM(model) as roomy:
        expected = roomy.generate(prompts, sp)
    with LLM(model, num_pages=48, page_size=4, max_prefill_tokens=16) as tight:
        tight.engine.overlap = overlap
        got = tight.generate(prompts, sp)
        assert tight.engine.stats().retracted_total > 0
    for ids, want, have in zip(prompts, expected, got, strict=True):
        assert [e.token_id for e in have["prompt_logprobs"]] == ids
        assert have["prompt_logprobs"][0].logprob is None
        tol = logprob_tolerance(model, context=len(ids) + 16)  # other chunks and batches: other rounding
        for w, h in zip(want["prompt_logprobs"][1:], have["prompt_logprobs"][1:], strict=True):
            assert h.logprob == pytest.approx(w.logprob, rel=0, abs=tol)
            assert h.top[0][0] == w.top[0][0] or abs(h.top[0][1] - w.top[0][1]) <= tol  # a near-tie may swap
        assert have["token_ids"] == want["token_ids"]
