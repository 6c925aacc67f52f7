"""Engine behaviour: prefix reuse, memory pressure, aborts, sampling semantics and bad input."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.engine.engine import Engine
from kubesgl.errors import ContextLengthError, InvalidRequestError, ModelNotFoundError
from kubesgl.models.random_init import build_random_model
from kubesgl.values.sampling import LogprobOptions
from support.numerics import assert_topk_matches, logprob_tolerance

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(build_random_model("qwen3", tmp_path_factory.mktemp("m") / "qwen3", init_std=0.5))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(500) for _ in range(n)]


def _baseline(engine: Engine) -> bool:
    s = engine.stats()
    return s.available_pages == s.total_pages and s.num_running == 0 and s.num_queued == 0


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_is_served_from_cache(model: str, page_size: int) -> None:
    prefix = _prompt(100, seed=1)
    with LLM(model, page_size=page_size) as llm:
        first = llm.generate([prefix + _prompt(5, 2)], GREEDY)[0]
        second = llm.generate([prefix + _prompt(7, 3)], GREEDY)[0]
        assert first["cached_tokens"] == 0
        assert second["cached_tokens"] >= 100 - 100 % page_size
        assert second["cached_tokens"] % page_size == 0
    with LLM(model, page_size=page_size, cache="naive") as naive:
        again = naive.generate([prefix + _prompt(7, 3)], GREEDY)[0]
        assert again["cached_tokens"] == 0
    assert again["token_ids"] == second["token_ids"]


@pytest.mark.slow  # 15-130 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_memory_pressure_evicts_and_preempts_without_changing_outputs(model: str) -> None:
    prompts = [_prompt(30 + i, seed=10 + i) for i in range(12)]
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    with LLM(model) as roomy:
        expected = [o["token_ids"] for o in roomy.generate(prompts, sp)]
    # Room for about two requests at a time: admission waits, cache is evicted, decoders are preempted.
    with LLM(model, num_pages=120, page_size=4) as tight:
        got = [o["token_ids"] for o in tight.generate(prompts, sp)]
        stats = tight.engine.stats()
        assert stats.retracted_total > 0
        assert _baseline(tight.engine)
    assert got == expected


def test_abort_mid_decode_frees_pages(model: str) -> None:
    with LLM(model, page_size=4) as llm:
        eng = llm.engine
        eng.add_request("a", _prompt(40, 1), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        eng.add_request("b", _prompt(20, 2), SamplingParams(max_tokens=50, temperature=0, ignore_eos=True))
        seen: list = []
        for _ in range(6):
            seen += eng.step()
        assert eng.stats().available_pages < eng.stats().total_pages
        eng.abort("a")
        eng.abort("waiting-never-existed")  # unknown ids are ignored
        while eng.has_work():
            seen += eng.step()
            if any(o.rid == "b" and not o.finished for o in seen):
                eng.abort("b")
        finals = {o.rid: o.finish_reason for o in seen if o.finished}
        assert finals == {"a": "abort", "b": "abort"}
        assert _baseline(eng)


def test_abort_while_queued(model: str) -> None:
    with LLM(model, max_running_requests=1) as llm:
        eng = llm.engine
        eng.add_request("run", _prompt(10, 1), GREEDY)
        eng.add_request("queued", _prompt(10, 2), GREEDY)
        eng.step()
        eng.abort("queued")
        outs = []
        while eng.has_work():
            outs += eng.step()
        assert [o.finish_reason for o in outs if o.rid == "queued"] == ["abort"]
        assert _baseline(eng)


def test_generate_times_each_prompts_first_token_from_the_call(model: str) -> None:
    """`ttft_s` is when a prompt's first token came back: one request running at a time, so each later prompt
    waits for the one before it to finish (bench serve's offline TTFT p99 is made of these)."""
    with LLM(model, max_running_requests=1) as llm:
        start = time.perf_counter()
        outs = llm.generate([_prompt(10, i) for i in range(3)], SamplingParams(max_tokens=4, ignore_eos=True))
        wall = time.perf_counter() - start
    ttfts = [o["ttft_s"] for o in outs]
    assert all(t is not None and 0 < t <= wall for t in ttfts), ttfts
    assert ttfts == sorted(ttfts) and len(set(ttfts)) == 3, ttfts


def test_generate_replays_arrivals_and_times_each_first_token_from_its_arrival(model: str) -> None:
    """`arrivals` hold a prompt back until its time (bench serve replays a served burst's sends with it): the
    late prompt's first token comes after its arrival, and its `ttft_s` counts from then. The tokens are the
    ones the prompts get all at once (greedy; each prompt's rows are its own)."""
    prompts = [_prompt(12, 40), _prompt(20, 41), _prompt(9, 42)]
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    late = 0.4
    with LLM(model) as llm:
        together = llm.generate(prompts, sp)
        llm.engine.flush_cache()
        start = time.perf_counter()
        spread = llm.generate(prompts, sp, arrivals=[0.0, late, 0.0])
        wall = time.perf_counter() - start
        assert _baseline(llm.engine)
    assert [o["token_ids"] for o in spread] == [o["token_ids"] for o in together]
    ttfts = [o["ttft_s"] for o in spread]
    # Given to the engine at once, the late prompt's first token would come well before its arrival: < 0 here.
    assert all(t is not None and t >= 0 for t in ttfts), ttfts
    assert wall >= late and ttfts[1] <= wall - late, (wall, ttfts)


@pytest.mark.parametrize(
    "arrivals",
    [[0.0], [0.0, -0.1], [0.0, float("nan")], [0.0, float("inf")], [0.0, True], [0.0, "1"]],
    ids=["too-few", "negative", "nan", "inf", "bool", "str"],
)
def test_generate_refuses_bad_arrivals_and_starts_nothing(model: str, arrivals: list) -> None:
    with LLM(model) as llm:
        with pytest.raises(InvalidRequestError, match="arrival"):
            llm.generate([_prompt(5, 1), _prompt(5, 2)], GREEDY, arrivals=arrivals)
        assert _baseline(llm.engine) and not llm.engine.has_work()


def test_flush_cache_drops_every_unused_prefix(model: str) -> None:
    prompt = _prompt(64, 7)
    with LLM(model, page_size=4) as llm:
        llm.generate([prompt], GREEDY)
        cached = llm.engine.stats().cached_prefix_pages
        assert cached >= 64 // 4
        assert llm.engine.flush_cache() == cached
        assert llm.engine.stats().cached_prefix_pages == 0 and _baseline(llm.engine)
        assert llm.generate([prompt], GREEDY)[0]["cached_tokens"] == 0


def test_seeded_sampling_is_reproducible(model: str) -> None:
    p = _prompt(12, 4)
    with LLM(model) as llm:
        a = llm.generate([p], SamplingParams(max_tokens=16, temperature=20.0, seed=123, ignore_eos=True))[0]
        b = llm.generate(
            [p, _prompt(30, 5)], SamplingParams(max_tokens=16, temperature=20.0, seed=123, ignore_eos=True)
        )[0]
        c = llm.generate([p], SamplingParams(max_tokens=16, temperature=20.0, seed=124, ignore_eos=True))[0]
    assert a["token_ids"] == b["token_ids"]  # batch company does not matter
    assert a["token_ids"] != c["token_ids"]


def test_top_k_one_equals_greedy(model: str) -> None:
    p = _prompt(15, 6)
    with LLM(model) as llm:
        greedy = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0]
        topk1 = llm.generate([p], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, ignore_eos=True))[0]
    assert greedy["token_ids"] == topk1["token_ids"]


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next(i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)


@pytest.mark.slow  # 15-130 s on 2 busy cores: `make test` runs it, `make test-fast` does not
def test_penalties_discourage_repeats(model: str) -> None:
    p = _prompt(15, 7)

    def run(**kw: float) -> list[int]:
        sp = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, **kw)
        return llm.generate([p], sp)[0]["token_ids"]

    with LLM(model) as llm:
        plain = run()
        # Presence/frequency penalties only lower tokens already generated: where the output first changes,
        # the unpenalized choice must have been a repeat; a negative penalty (a reward) must pick a repeat.
        for kw in ({"presence_penalty": 2.0}, {"frequency_penalty": 2.0}):
            out = run(**kw)
            i = _first_divergence(plain, out)
            assert plain[i] in plain[:i], (kw, i, plain, out)
        rewarded = run(frequency_penalty=-2.0)
        if rewarded != plain:
            i = _first_divergence(plain, rewarded)
            assert rewarded[i] in rewarded[:i]
        # An overwhelming repetition penalty (prompt and output) forbids every token seen so far.
        strict = run(repetition_penalty=1e6)
        assert len(set(strict)) == len(strict) and not set(strict) & set(p)


def test_sampler_penalty_directions() -> None:
    from kubesgl.engine.plan import SlotInit
    from kubesgl.engine.sampler import Sampler

    s = Sampler(4, torch.device("cpu"))
    s.init_slots(
        [
            SlotInit(0, 2, SamplingParams(temperature=0.0, repetition_penalty=2.0), 0),
            SlotInit(1, 2, SamplingParams(temperature=0.0, presence_penalty=1.0), 0),
        ]
    )
    pool = torch.tensor([[3, 1, 3, 0], [1, 2, 3, 0], [0] * 4, [0] * 4])
    logits = torch.tensor([[1.0, 2.0, 0.5, 3.0], [1.0, 2.0, 0.5, 2.9]])
    penalized = s._apply_penalties(logits.clone(), torch.tensor([0, 1]), [3, 3], pool)
    assert penalized[0, 3] == pytest.approx(1.5)  # repetition: positive logit of a seen token divided
    assert penalized[0, 2] == pytest.approx(0.5)  # unseen token unchanged
    assert penalized[1, 3] == pytest.approx(
        1.9
    )  # presence: output token (pos 2 >= prompt_len 2) lowered by 1
    assert penalized[1, 1] == pytest.approx(2.0)  # prompt tokens are not output tokens


def test_top_p_and_min_p_restrict_choices(model: str) -> None:
    p = _prompt(10, 8)
    with LLM(model) as llm:
        greedy = llm.generate([p], SamplingParams(max_tokens=1, temperature=0))[0]["token_ids"]
        for seed in range(8):
            tiny_p = llm.generate([p], SamplingParams(max_tokens=1, temperature=5.0, top_p=1e-6, seed=seed))[
                0
            ]
            full_min_p = llm.generate(
                [p], SamplingParams(max_tokens=1, temperature=5.0, min_p=1.0, seed=seed)
            )[0]
            assert tiny_p["token_ids"] == greedy
            assert full_min_p["token_ids"] == greedy


def test_stop_token_ends_with_stop(model: str) -> None:
    p = _prompt(12, 9)
    with LLM(model) as llm:
        free = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))[0][
            "token_ids"
        ]
        stop_id = free[2]  # generation must end at its first occurrence
        stopped = llm.generate([p], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=(stop_id,)))[
            0
        ]
    assert stopped["finish_reason"] == "stop"
    assert stopped["token_ids"][-1] == stop_id
    assert stopped["token_ids"] == free[: free.index(stop_id) + 1]


def test_logprobs_are_log_softmax_of_the_model(model: str) -> None:
    from transformers import AutoModelForCausalLM

    p = _prompt(9, 10)
    with LLM(model) as llm:
        out = llm.generate(
            [p],
            SamplingParams(
                max_tokens=3,
                temperature=0,
                logprobs=LogprobOptions(top=3),
            ),
        )[0]
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    ids = list(p)
    for tok, lp in zip(out["token_ids"], out["logprobs"], strict=True):
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].float(), -1)
        tol = logprob_tolerance(model, context=len(ids))  # transformers sums in other orders
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(ref[tok]), rel=0, abs=tol)
        assert_topk_matches([t for t, _ in lp.top], ref, tol)
        ids.append(tok)


@pytest.mark.parametrize(
    ("prompt", "params", "error"),
    [
        ([], SamplingParams(), InvalidRequestError),
        ([1] * 5000, SamplingParams(), ContextLengthError),
        ([1, 2], SamplingParams(max_tokens=-1), InvalidRequestError),
        ([1, 2], SamplingParams(top_p=-0.1), InvalidRequestError),
        ([1, 2], SamplingParams(top_p=1.5), InvalidRequestError),
        ([1, 2], SamplingParams(temperature=-1), InvalidRequestError),
        ([1, 10**9], SamplingParams(), InvalidRequestError),
    ],
)
def test_bad_input_raises_and_leaks_nothing(
    model: str, prompt: list[int], params: SamplingParams, error: type
) -> None:
    with LLM(model, max_seq_len_override=4096) as llm:
        with pytest.raises(error):
            llm.generate([[5, 6, 7], prompt], params)
        assert _baseline(llm.engine)
        assert llm.generate([[5, 6, 7]], GREEDY)[0]["finish_reason"] == "length"  # still serving


def test_unknown_model_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM(str(tmp_path / "no-such-model"))


def test_sequence_outgrowing_the_kv_cache_ends_with_length(model: str) -> None:
    # 12 pages of 4 tokens: a 20-token prompt can grow to 48 tokens, then the cache is full.
    with LLM(model, num_pages=12, page_size=4) as llm:
        out = llm.generate([_prompt(20, 3)], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[
            0
        ]
        assert out["finish_reason"] == "length"
        assert 20 + len(out["token_ids"]) <= 12 * 4 + 1
        assert _baseline(llm.engine)
        with pytest.raises(ContextLengthError, match="KV cache"):
            llm.generate([_prompt(60, 4)], GREEDY)
        # Two requests that cannot both fit: one is preempted, both finish, nothing hangs or leaks.
        outs = llm.generate(
            [_prompt(18, 5), _prompt(18, 6)], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
        )
        assert [o["finish_reason"] for o in outs] == ["length", "length"]
        assert _baseline(llm.engine)


def test_max_tokens_none_runs_to_the_context_end_or_the_server_default(model: str) -> None:
    p = _prompt(10, 21)
    open_ended = SamplingParams(max_tokens=None, temperature=0, ignore_eos=True)
    with LLM(model, max_seq_len_override=40) as llm:
        out = llm.generate([p], open_ended)[0]
        assert (len(out["token_ids"]), out["finish_reason"]) == (30, "length")  # the rest of the context
    with LLM(model, max_seq_len_override=40, default_max_tokens=6) as llm:
        capped, explicit = llm.generate([p, p], [open_ended, SamplingParams(max_tokens=9, ignore_eos=True)])
        assert (len(capped["token_ids"]), capped["finish_reason"]) == (6, "length")
        assert len(explicit["token_ids"]) == 9  # the default only fills in a missing max_tokens
        llm.engine.add_request("near-end", _prompt(37, 22), open_ended)  # min(default, rest of context)
        outs = []
        while llm.engine.has_work():
            outs += llm.engine.step()
        assert sum(len(o.new_token_ids) for o in outs if o.rid == "near-end") == 3


def test_llm_demo_is_the_demo_model_offline(demo_model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`LLM("demo")` finds (or builds) `kubesgl up`'s demo model in $KUBESGL_CACHE, with no network."""
    monkeypatch.setenv("KUBESGL_CACHE", str(Path(demo_model_dir).parent))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    with LLM("demo", num_pages=256) as demo, LLM(demo_model_dir, num_pages=256) as by_path:
        out = demo.generate(["Hello"], params)[0]
        again = by_path.generate(["Hello"], params)[0]
        assert out.pop("ttft_s") > 0 and again.pop("ttft_s") > 0  # the rest is the same model's answer
        assert out == again
    assert len(out["token_ids"]) == 4 and isinstance(out["text"], str)
