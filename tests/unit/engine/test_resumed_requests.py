"""Resumed requests (the engine half of request migration): a request admitted with its first k output tokens
already generated continues exactly where the first run was, for greedy, seeded (with filters and penalties)
and grammar-constrained sampling, whatever shares its batch; usage counts the given tokens once."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from kubesgl import LLM, SamplingParams
from kubesgl.errors import ContextLengthError, InvalidRequestError
from kubesgl.values.constraint import Constraint
from kubesgl.values.outputs import FinishReason
from kubesgl.values.sampling import LogprobOptions

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(
    max_tokens=20, temperature=1.3, top_p=0.9, frequency_penalty=0.5, seed=7, ignore_eos=True
)


@pytest.fixture(scope="module")
def llm(demo_model_dir: str):  # type: ignore[no-untyped-def]
    with LLM(demo_model_dir, num_pages=1024, page_size=4) as engine:
        yield engine


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 20000) for _ in range(n)]


def _run(llm: LLM, requests: Sequence[tuple[list[int], SamplingParams, list[int]]]) -> list[dict]:
    """Each (prompt, params, output so far) to its end, in one batch: the new tokens and the last output."""
    rids = [f"resume-{i}-{random.getrandbits(32)}" for i in range(len(requests))]
    for rid, (prompt, params, output) in zip(rids, requests, strict=True):
        llm.engine.add_request(rid, prompt, params, output)
    got: dict[str, dict] = {rid: {"new": [], "logprobs": []} for rid in rids}
    while any("last" not in g for g in got.values()):
        for out in llm.engine.step():
            g = got[out.rid]
            g["new"] += out.new_token_ids
            g["logprobs"] += out.logprobs or []
            if out.finished:
                g["last"] = out
    return [got[rid] for rid in rids]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_resumed_request_continues_with_the_same_tokens(llm: LLM, params: SamplingParams) -> None:
    prompt = _prompt(40, 1)
    (full,) = _run(llm, [(prompt, params, [])])
    tokens = full["new"]
    assert len(tokens) == 20
    for k in (1, 7, 19):
        # The resumed one shares its batch with strangers, as on a surviving instance.
        resumed, *_ = _run(
            llm, [(prompt, params, tokens[:k]), (_prompt(25, 2), SEEDED, []), (_prompt(9, 3), GREEDY, [])]
        )
        assert resumed["new"] == tokens[k:], f"resumed after {k} tokens"
        last = resumed["last"]
        assert (last.completion_tokens, last.prompt_tokens) == (20, 40)
        assert last.finish_reason is FinishReason.LENGTH


def test_resumed_request_reports_logprobs_of_its_new_tokens_only(llm: LLM) -> None:
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=LogprobOptions(top=2))
    prompt = _prompt(30, 4)
    (full,) = _run(llm, [(prompt, params, [])])
    (resumed,) = _run(llm, [(prompt, params, full["new"][:4])])
    assert resumed["new"] == full["new"][4:]
    assert [lp.token_id for lp in resumed["logprobs"]] == full["new"][4:]


def test_resumed_constrained_request_advances_its_grammar_over_the_given_output(llm: LLM) -> None:
    params = SamplingParams(
        max_tokens=24,
        temperature=1.0,
        seed=3,
        constraint=Constraint(kind="regex", source=r"[a-c]{6}-\d{4}"),
    )
    prompt = _prompt(12, 5)
    (full,) = _run(llm, [(prompt, params, [])])
    tokens = full["new"]
    assert full["last"].finish_reason is FinishReason.STOP
    text = llm.tokenizer.decode(tokens)
    assert len(tokens) >= 2, text
    (resumed,) = _run(llm, [(prompt, params, tokens[:2])])
    assert resumed["new"] == tokens[2:]
    assert resumed["last"].finish_reason is FinishReason.STOP


def test_resume_refuses_output_the_request_cannot_continue(llm: LLM, demo_model_dir: str) -> None:
    prompt = _prompt(10, 6)
    with pytest.raises(InvalidRequestError, match="nothing is left to generate"):
        llm.engine.add_request("full-already", prompt, SamplingParams(max_tokens=3), [5, 6, 7])
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        llm.engine.add_request("bad-token", prompt, GREEDY, [10**9])
    ctx = llm.engine.info.context_len
    with pytest.raises(ContextLengthError, match="no room is left"):
        llm.engine.add_request("too-long", prompt, SamplingParams(max_tokens=None), [5] * (ctx - len(prompt)))
