"""Prefill/decode disaggregation in the engine, for every model family of the parity set: a prefill engine and a
decode engine, their KV pages moved by real NIXL agents (UCX over host memory), give what one colocated engine
gives — greedy tokens over chunked prompts and prefix-cache hits on both sides, two requests of one prompt (a
request's n = 2 is two child requests to the engine), prompt logprobs and a JSON-schema constraint. The decode
engine reads the pulled pages (wrong bytes in them change its tokens), so the comparison checks the transfer. A
transfer that fails or a prefill that never answers falls back to prefilling on the decode engine; an abort
mid-transfer ends the request.

Tolerances. Tokens are compared exactly: the prompt's KV is computed by the same scheduler code in extend batches
of the same shapes as the colocated engine's (all requests of a round are added at once, prefill steps carry no
decode rows) and its bytes are copied bit for bit; the decode batches differ, which only a near-tie could show,
and the random weights (init_std 0.5) keep the top-2 gaps far above float32 rounding. Prompt logprobs are
compared exactly: the prefill engine computes them in the same prefill as the colocated engine, run alone on
both. The logprobs of the tokens the decode engine samples are not bit-identical: it recomputes the prompt's last
partial page and the first token in an extend of its own length (another GEMM shape), so they are compared
within support.numerics' float32 tolerance.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from kubesgl import LLM, SamplingParams
from kubesgl.engine.engine import Engine
from kubesgl.engine.scheduler.disagg import DecodeRole, KvHandoff, PrefillRole, TransferOutcome
from kubesgl.kv.kv_transfer import KvTransferAgent
from kubesgl.models.random_init import build_random_model
from kubesgl.values.constraint import Constraint
from kubesgl.values.outputs import FinishReason, RequestOutput, TokenLogprob
from kubesgl.values.sampling import LogprobOptions
from support.model_helpers import PARITY_ARCHS, with_byte_level_tokenizer
from support.numerics import logprob_tolerance

pytest.importorskip("nixl_cu12", reason="NIXL (the disagg extra) is not installed")

PAGE = 4
CONFIG: dict[str, Any] = {"num_pages": 512, "page_size": PAGE, "max_prefill_tokens": 16}  # prompts chunk
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(2, 500) for _ in range(n)]  # the tiny vocab's, past its two special tokens


class _Pair:
    """The decode engine owns every request; the prefill engine computes prompts; outputs gather by rid."""

    def __init__(self, prefill: Engine, decode: Engine) -> None:
        self.p_agent = KvTransferAgent("prefill", prefill.runner.kv)
        self.d_agent = KvTransferAgent("decode", decode.runner.kv)
        self.prefill, self.decode = prefill, decode
        self.p_role = PrefillRole(prefill.scheduler, self.p_agent)
        self.d_role = DecodeRole(decode.scheduler, self.d_agent)
        self.results: dict[str, dict[str, Any]] = {}
        self.asked: dict[str, tuple[list[int], SamplingParams]] = {}
        self._rids = iter(range(1 << 30))

    def add(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.asked[rid] = (ids, params)
        self.results[rid] = {"token_ids": [], "logprobs": [], "finish_reason": None}
        self.p_role.add(rid, ids, params)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[dict[str, Any]]:
        """LLM.generate's results for `prompts`, all added at once, computed by the pair."""
        rids = [f"r{next(self._rids)}" for _ in prompts]
        for rid, ids in zip(rids, prompts, strict=True):
            self.add(rid, ids, params)
        results = self.run()
        return [results[rid] for rid in rids]

    def _take(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            r = self.results[out.rid]
            r["token_ids"] += out.new_token_ids
            r["logprobs"] += out.logprobs or []
            r["cached_tokens"] = out.cached_tokens
            if out.prompt_logprobs is not None:
                r["prompt_logprobs"] = out.prompt_logprobs
            if out.finished:
                r["finish_reason"] = out.finish_reason

    def step_prefill(self) -> list[KvHandoff]:
        self._take(self.prefill.step())  # requests that finished at their first token end here
        return self.p_role.take_handoffs()

    def receive(self, h: KvHandoff) -> None:
        ids, params = self.asked[h.rid]
        self._take([self.d_role.receive(ids, params, h)])

    def run(self) -> dict[str, dict[str, Any]]:
        while any(r["finish_reason"] is None for r in self.results.values()):
            for h in self.step_prefill():
                self.receive(h)
            for rid in self.d_role.poll():
                self.p_role.release(rid)
            self._take(self.decode.step())
        return self.results

    def close(self) -> None:
        self.p_agent.close()
        self.d_agent.close()


@dataclass
class Family:
    """One model family's checkpoint, a colocated engine, and a prefill/decode pair of the same config."""

    arch: str
    model: Path
    both: LLM
    pair: _Pair


@pytest.fixture(scope="module", params=PARITY_ARCHS)
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Family]:
    arch = request.param
    model = build_random_model(arch, tmp_path_factory.mktemp(arch), init_std=0.5)
    with_byte_level_tokenizer(model)  # structured outputs need a tokenizer
    with LLM(str(model), **CONFIG) as both, LLM(str(model), **CONFIG) as p, LLM(str(model), **CONFIG) as d:
        pair = _Pair(p.engine, d.engine)
        yield Family(arch, model, both, pair)
        pair.close()


def _holds(engine: Engine, tokens: list[int]) -> bool:
    """Whether the engine's prefix cache holds all of `tokens` (whole pages)."""
    handle, pages = engine.cache.match_prefix(tokens)
    engine.cache.release(handle)
    return len(pages) * PAGE == len(tokens)


def _same(got: list[dict[str, Any]], want: list[dict[str, Any]]) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g["token_ids"] == w["token_ids"], i
        assert (g["finish_reason"], g["cached_tokens"]) == (w["finish_reason"], w["cached_tokens"]), i


def test_greedy_matches_colocated_over_chunks_and_prefix_hits(family: Family) -> None:
    both, pair = family.both, family.pair
    pair.d_role.take_ended()
    shared = _prompt(24, 1)  # six pages
    # Three chunks; the shared prefix; one page and a token; shorter than a page (nothing to pull).
    first = [_prompt(37, 2), shared + _prompt(9, 3), _prompt(5, 4), _prompt(3, 5)]
    _same(pair.generate(first, GREEDY), both.generate(first, GREEDY))
    c = pair.d_role.counters
    assert c.transfers == 3 and c.fallbacks == 0 and c.transferred_bytes > 0
    ends = pair.d_role.take_ended()  # what the decode instance's kv transfer spans are made of
    assert sorted((e.outcome, e.pages) for e in ends) == [
        (TransferOutcome.OK, n // PAGE) for n in (5, 33, 37)
    ]
    assert sum(e.nbytes for e in ends) == c.transferred_bytes and all(e.seconds > 0 for e in ends)
    # Both sides now cache the shared prefix: the prefill engine computed it, the decode engine pulled it.
    assert _holds(pair.prefill, shared) and _holds(pair.decode, shared)
    # n = 2 (two requests of one prompt), and another prompt on the prefix.
    second = [shared + _prompt(13, 6)] * 2 + [shared + _prompt(6, 7)]
    got = pair.generate(second, GREEDY)
    _same(got, both.generate(second, GREEDY))
    assert all(g["cached_tokens"] >= len(shared) for g in got)
    assert c.fallbacks == 0
    # Every page the prefill side locked for transfer was unlocked: nothing in its cache stays pinned.
    assert pair.prefill.cache.evictable_pages == pair.prefill.cache.cached_pages


def _assert_logprobs_close(got: list[TokenLogprob], want: list[TokenLogprob], tol: float) -> None:
    """The same tokens, their logprobs and their alternatives' (best first) within `tol`; a near-tie among the
    alternatives may swap their ids, so only the values are compared in rank order."""
    assert [t.token_id for t in got] == [t.token_id for t in want]
    for g, w in zip(got, want, strict=True):
        assert g.logprob is not None and w.logprob is not None
        assert abs(g.logprob - w.logprob) <= tol, (g, w)
        assert len(g.top) == len(w.top)
        assert all(abs(a - b) <= tol for (_, a), (_, b) in zip(g.top, w.top, strict=True)), (g, w)


def test_prompt_logprobs_match_colocated(family: Family) -> None:
    lp = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logprobs=LogprobOptions(top=2, prompt_start=0)
    )
    prompt = _prompt(30, 8)  # two chunks, seven pages and two tokens
    (want,) = family.both.generate([prompt], lp)
    (got,) = family.pair.generate([prompt], lp)
    assert got["token_ids"] == want["token_ids"]
    assert got["prompt_logprobs"] == want["prompt_logprobs"]  # the same prefill, bit for bit
    assert got["logprobs"][0] == want["logprobs"][0]  # the prefill engine's first token: the same step
    tol = logprob_tolerance(family.model, context=len(prompt) + lp.max_tokens)
    _assert_logprobs_close(got["logprobs"][1:], want["logprobs"][1:], tol)


def test_structured_output_matches_colocated(family: Family) -> None:
    schema = Constraint.json_schema(
        '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    )
    js = SamplingParams(max_tokens=16, temperature=0, constraint=schema)
    prompts = [_prompt(11, 9), _prompt(18, 10)]
    want = family.both.generate(prompts, js)
    # The grammar steered the random weights (which pick JSON's optional whitespace often).
    assert all("".join(w["text"].split()).startswith('{"a":') for w in want), [w["text"] for w in want]
    _same(family.pair.generate(prompts, js), want)


def test_decode_reads_the_pulled_pages(family: Family) -> None:
    """Wrong bytes in the prefill side's pages, pulled as they are, change the decode side's tokens: the
    comparisons above would catch a transfer that moved the wrong pages or none."""
    pair, prompt = family.pair, _prompt(33, 11)
    (want,) = family.both.generate([prompt], GREEDY)
    pair.add("wrong", prompt, GREEDY)
    handoffs: list[KvHandoff] = []
    while not handoffs:
        handoffs = pair.step_prefill()
    handle, pages = pair.prefill.cache.match_prefix(prompt)
    k, v = pair.prefill.runner.kv.buffers()
    saved = k[:, pages].clone(), v[:, pages].clone()
    gen = torch.Generator().manual_seed(0)
    k[:, pages] = torch.randn(saved[0].shape, generator=gen).to(k.dtype)
    v[:, pages] = torch.randn(saved[1].shape, generator=gen).to(v.dtype)
    transfers, fallbacks = pair.d_role.counters.transfers, pair.d_role.counters.fallbacks
    try:
        (h,) = handoffs
        pair.receive(h)
        got = pair.run()["wrong"]
    finally:
        k[:, pages], v[:, pages] = saved  # the prefill side's cache holds the right KV again
        pair.prefill.cache.release(handle)
    assert (pair.d_role.counters.transfers, pair.d_role.counters.fallbacks) == (transfers + 1, fallbacks)
    assert got["token_ids"][0] == want["token_ids"][0]  # sampled by the prefill engine, before the transfer
    assert got["token_ids"] != want["token_ids"]


def test_failed_transfer_falls_back_to_prefill_on_decode(
    family: Family, caplog: pytest.LogCaptureFixture
) -> None:
    both, pair = family.both, family.pair
    ids = _prompt(29, 12)
    (want,) = both.generate([ids], GREEDY)
    pair.add("f", ids, GREEDY)
    handoffs: list[KvHandoff] = []
    while not handoffs:
        handoffs = pair.step_prefill()
    # The prefill instance is gone before the pull: its descriptors name memory no agent serves any more.
    (h,) = handoffs
    pair.p_role.release("f")
    dead = KvHandoff(h.rid, h.seed, h.output, h.logprobs, h.num_pages, b"not an agent", h.descs)
    before = pair.d_role.counters.fallbacks
    pair.d_role.take_ended()
    with caplog.at_level("WARNING", logger="kubesgl.scheduler.pd"):
        pair.receive(dead)
    assert [e.outcome for e in pair.d_role.take_ended()] == [TransferOutcome.UNREACHABLE]
    assert "cannot pull f's pages" in caplog.text  # why, for the operator: the fallback alone does not say
    got = pair.run()
    assert got["f"]["token_ids"] == want["token_ids"]
    assert pair.d_role.counters.fallbacks == before + 1


def test_no_handoff_prefills_on_decode(family: Family) -> None:
    both, pair = family.both, family.pair
    ids = _prompt(21, 13)
    (want,) = both.generate([ids], GREEDY)
    pair.results["lost"] = {"token_ids": [], "logprobs": [], "finish_reason": None}
    pair.d_role.prefill_here("lost", ids, GREEDY)  # the prefill instance died before any token
    assert pair.run()["lost"]["token_ids"] == want["token_ids"]


def test_abort_mid_transfer_ends_request_and_frees_pages(family: Family) -> None:
    pair = family.pair
    free = pair.decode.pool.num_free + pair.decode.cache.evictable_pages
    pair.add("ab", _prompt(33, 14), GREEDY)
    handoffs: list[KvHandoff] = []
    while not handoffs:
        handoffs = pair.step_prefill()
    pair.receive(handoffs[0])
    pair.d_role.take_ended()
    pair.d_role.abort("ab")
    assert [e.outcome for e in pair.d_role.take_ended()] == [TransferOutcome.ABORTED]
    got = pair.run()
    assert got["ab"]["finish_reason"] == FinishReason.ABORT
    while pair.d_role.busy:
        for rid in pair.d_role.poll():
            pair.p_role.release(rid)
    assert pair.decode.pool.num_free + pair.decode.cache.evictable_pages == free


def test_a_pull_given_up_when_its_prefill_instance_dies_goes_on_without_its_pages(family: Family) -> None:
    """The bus side declares the prefill instance dead mid-pull (its heartbeats stopped): the request is
    prefilled here at once, with the colocated tokens, and the pull's pages go back when NIXL lets go."""
    both, pair = family.both, family.pair
    ids = _prompt(31, 15)
    (want,) = both.generate([ids], GREEDY)
    free = pair.decode.pool.num_free + pair.decode.cache.evictable_pages
    pair.add("gone", ids, GREEDY)
    handoffs: list[KvHandoff] = []
    while not handoffs:
        handoffs = pair.step_prefill()
    before = pair.d_role.counters.fallbacks
    pair.receive(handoffs[0])
    pair.d_role.take_ended()
    assert pair.d_role.pulling("gone")
    pair.d_role.give_up("gone")
    pair.d_role.give_up("gone")  # every step asks again while the peer stays dead: one outcome
    assert [e.outcome for e in pair.d_role.take_ended()] == [TransferOutcome.PEER_GONE]
    assert pair.d_role.counters.fallbacks == before + 1
    got = pair.run()
    assert got["gone"]["token_ids"] == want["token_ids"]
    while pair.d_role.busy:
        for rid in pair.d_role.poll():
            pair.p_role.release(rid)
    assert pair.decode.pool.num_free + pair.decode.cache.evictable_pages == free


def test_a_prompt_released_before_its_handoff_stops_and_locks_nothing(family: Family) -> None:
    """The decode side gave up on a prompt still being computed (its request aborted, or prefilled there):
    the prefill side aborts it, hands nothing off, and its pool is as before."""
    pair = family.pair
    prefill = pair.prefill
    free = prefill.pool.num_free + prefill.cache.evictable_pages
    pair.add("dropped", _prompt(41, 16), GREEDY)  # 41 tokens, 16 a step: three chunks
    assert pair.step_prefill() == []  # the first chunk only
    pair.p_role.release("dropped")
    while prefill.has_work():
        assert pair.step_prefill() == []
    assert pair.results.pop("dropped")["finish_reason"] == FinishReason.ABORT
    assert prefill.pool.num_free + prefill.cache.evictable_pages == free
