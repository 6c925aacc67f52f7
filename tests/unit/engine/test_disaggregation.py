"""Prefill/decode disaggregation in the engine: a prefill engine and a decode engine, their KV pages moved by
real NIXL agents (UCX over host memory), give the tokens one colocated engine gives: greedy, chunked prompts,
prefix-cache hits on either side, prompt logprobs and structured outputs; a transfer that fails or a prefill
that never answers falls back to prefilling on the decode engine; an abort mid-transfer ends the request."""

from __future__ import annotations

import random
from typing import Any

import pytest
from kubesgl import LLM, SamplingParams
from kubesgl.engine.engine import Engine
from kubesgl.engine.scheduler.disagg import DecodeRole, KvHandoff, PrefillRole
from kubesgl.kv.kv_transfer import KvTransferAgent
from kubesgl.values.constraint import Constraint
from kubesgl.values.outputs import FinishReason
from kubesgl.values.sampling import LogprobOptions

pytest.importorskip("nixl_cu12", reason="NIXL (the disagg extra) is not installed")

CONFIG: dict[str, Any] = {"num_pages": 512, "page_size": 4, "max_prefill_tokens": 16}  # prompts chunk
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000) for _ in range(n)]


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

    def add(self, rid: str, ids: list[int], params: SamplingParams) -> None:
        self.asked[rid] = (ids, params)
        self.results[rid] = {"token_ids": [], "finish_reason": None}
        self.p_role.add(rid, ids, params)

    def _take(self, outs: list) -> None:  # type: ignore[type-arg]
        for out in outs:
            r = self.results[out.rid]
            r["token_ids"] += out.new_token_ids
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


@pytest.fixture(scope="module")
def engines(demo_model_dir: str):  # type: ignore[no-untyped-def]
    with (
        LLM(demo_model_dir, **CONFIG) as both,
        LLM(demo_model_dir, **CONFIG) as prefill,
        LLM(demo_model_dir, **CONFIG) as decode,
    ):
        pair = _Pair(prefill.engine, decode.engine)
        yield both, pair
        pair.close()


def _colocated(both: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> list[dict[str, Any]]:
    return both.generate(prompts, params)


def test_disaggregated_greedy_matches_colocated(engines) -> None:  # type: ignore[no-untyped-def]
    both, pair = engines
    shared = _prompt(24, 1)
    prompts = [_prompt(37, 2), shared + _prompt(9, 3), shared + _prompt(13, 4), _prompt(5, 5), _prompt(3, 6)]
    params = [GREEDY] * len(prompts)
    want = _colocated(both, prompts, params)
    for i, (ids, p) in enumerate(zip(prompts, params, strict=True)):
        pair.add(f"g{i}", ids, p)
    got = pair.run()
    for i, w in enumerate(want):
        assert got[f"g{i}"]["token_ids"] == w["token_ids"], i
        assert got[f"g{i}"]["finish_reason"] == w["finish_reason"]
    c = pair.d_role.counters
    assert c.transfers >= 4 and c.fallbacks == 0 and c.transferred_bytes > 0
    # Every page the prefill side locked for transfer was unlocked: nothing in its cache stays pinned.
    assert pair.prefill.cache.evictable_pages == pair.prefill.cache.cached_pages


def test_prompt_logprobs_and_structured_outputs_match_colocated(engines) -> None:  # type: ignore[no-untyped-def]
    both, pair = engines
    lp = SamplingParams(
        max_tokens=6, temperature=0, ignore_eos=True, logprobs=LogprobOptions(top=2, prompt_start=0)
    )
    schema = Constraint.json_schema(
        '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}'
    )
    js = SamplingParams(max_tokens=24, temperature=0, constraint=schema)
    prompts = [_prompt(30, 7), _prompt(11, 8)]
    want = _colocated(both, prompts, [lp, js])
    pair.add("lp", prompts[0], lp)
    pair.add("js", prompts[1], js)
    got = pair.run()
    assert got["lp"]["token_ids"] == want[0]["token_ids"]
    assert [t.token_id for t in got["lp"]["prompt_logprobs"]] == [
        t.token_id for t in want[0]["prompt_logprobs"]
    ]
    assert got["js"]["token_ids"] == want[1]["token_ids"]


def test_failed_transfer_falls_back_to_prefill_on_decode(engines) -> None:  # type: ignore[no-untyped-def]
    both, pair = engines
    ids = _prompt(29, 9)
    (want,) = _colocated(both, [ids], [GREEDY])
    pair.add("f", ids, GREEDY)
    handoffs: list[KvHandoff] = []
    while not handoffs:
        handoffs = pair.step_prefill()
    # The prefill instance is gone before the pull: its descriptors name memory no agent serves any more.
    (h,) = handoffs
    pair.p_role.release("f")
    dead = KvHandoff(h.rid, h.seed, h.output, h.logprobs, h.num_pages, b"not an agent", h.descs)
    before = pair.d_role.counters.fallbacks
    pair.receive(dead)
    got = pair.run()
    assert got["f"]["token_ids"] == want["token_ids"]
    assert pair.d_role.counters.fallbacks == before + 1


def test_no_handoff_prefills_on_decode(engines) -> None:  # type: ignore[no-untyped-def]
    both, pair = engines
    ids = _prompt(21, 10)
    (want,) = _colocated(both, [ids], [GREEDY])
    pair.results["lost"] = {"token_ids": [], "finish_reason": None}
    pair.d_role.prefill_here("lost", ids, GREEDY)  # the prefill instance died before any token
    assert pair.run()["lost"]["token_ids"] == want["token_ids"]


def test_abort_mid_transfer_ends_request_and_frees_pages(engines) -> None:  # type: ignore[no-untyped-def]
    _, pair = engines
    free = pair.decode.pool.num_free + pair.decode.cache.evictable_pages
    pair.add("ab", _prompt(33, 11), GREEDY)
    handoffs: list[KvHandoff] = []
    while not handoffs:
        handoffs = pair.step_prefill()
    pair.receive(handoffs[0])
    pair.d_role.abort("ab")
    got = pair.run()
    assert got["ab"]["finish_reason"] == FinishReason.ABORT
    while pair.d_role.busy:
        for rid in pair.d_role.poll():
            pair.p_role.release(rid)
    assert pair.decode.pool.num_free + pair.decode.cache.evictable_pages == free
