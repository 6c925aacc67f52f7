"""Constrained generation without a model, for tests: `RandomLogits` (a fake standing in for the language
model, which these tests are not about) gives seeded random logits per (request, step); `generate` runs a
batch through our masking (TokenBitmask + apply_token_bitmask_), accepting each token into the request's
grammar exactly as the scheduler will.

Greedy rows go through the engine's Sampler. Seeded rows draw with torch.multinomial from a generator keyed
on (request, step) (batch-independent, like the engine's seeded rows): the engine's seeded path can pick a
zero-probability token today (test_structured_outputs pins that bug with an xfail)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from kubesgl.engine.plan import SlotInit
from kubesgl.engine.sampler import Sampler
from kubesgl.structured.bitmask import Backend, apply_token_bitmask_
from kubesgl.structured.compiler import GrammarCompiler
from kubesgl.structured.constraint import Constraint
from kubesgl.structured.matcher import GrammarState, TokenBitmask
from kubesgl.values.sampling import SamplingParams

QWEN3_VOCAB = 151936
QWEN3_EOS = (151645, 151643)


class RandomLogits:
    """Fake LM: logits drawn from N(0, 1) by a generator keyed on (seed, request, step), so a request's
    logits do not depend on what else shares its batch. `favoured` tokens get `boost` added: with them the
    random walk through a JSON string reaches its closing quote in tens of steps, not ~10^5."""

    def __init__(self, vocab_size: int, seed: int, favoured: list[int] | None = None, boost: float = 10.0):
        self.vocab_size, self.seed = vocab_size, seed
        self.bias = torch.zeros(vocab_size)
        if favoured:
            self.bias[favoured] = boost

    def __call__(self, request: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + request) * 10_007 + step)
        return torch.randn(self.vocab_size, generator=g).add_(self.bias)


@functools.cache  # per tokenizer object (hashed by identity): every caller asks again
def single_ascii_tokens(tokenizer) -> list[int]:  # type: ignore[no-untyped-def]
    """Ids of the tokens that decode to one printable ASCII character (digits, letters, punctuation).

    Only tokens spelled with one vocabulary character are decoded (a byte-level BPE token decodes to one byte per
    character of its spelling): decoding all ~150k took ~5 s."""
    spelled = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    short = [tid for tid, t in enumerate(spelled) if t is not None and len(t) == 1]
    texts = tokenizer.batch_decode([[tid] for tid in short])
    return [
        tid for tid, s in zip(short, texts, strict=True) if len(s) == 1 and s.isascii() and s.isprintable()
    ]


def terminating_random_logits(tokenizer, seed: int) -> RandomLogits:  # type: ignore[no-untyped-def]
    """Favours one-character ASCII tokens and the stop tokens: random walks through strings and grammars
    then end within a few hundred steps."""
    return RandomLogits(QWEN3_VOCAB, seed, favoured=[*single_ascii_tokens(tokenizer), *QWEN3_EOS])


@dataclass
class Generated:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    masked_logits: list[torch.Tensor] = field(default_factory=list)  # per step, when kept


@dataclass(frozen=True)
class Row:
    """One request of a batch: its id (keys its random logits and sampling seed) and its constraint."""

    request: int
    constraint: Constraint | None = None
    stop_token_ids: tuple[int, ...] | None = None


def generate(
    compiler: GrammarCompiler,
    model: RandomLogits,
    rows: list[Row],
    *,
    greedy: bool = True,
    max_tokens: int = 256,
    eos: tuple[int, ...] = QWEN3_EOS,
    backend: Backend = "auto",
    keep_logits: bool = False,
) -> list[Generated]:
    """Decodes every row to a stop token or max_tokens. Finished rows stay in the batch (fixed shape, as
    in a captured graph) and their later tokens are dropped, like the engine's in-flight tokens."""
    n, vocab = len(rows), model.vocab_size
    states = [
        GrammarState(compiler.compile(r.constraint), r.stop_token_ids) if r.constraint else None for r in rows
    ]
    sampler = Sampler(n, torch.device("cpu"))  # greedy rows: temperature 0
    sampler.init_slots([SlotInit(i, 0, SamplingParams(temperature=0.0), 0) for i in range(n)])
    mask = TokenBitmask(n, vocab, torch.device("cpu"))
    token_pool = torch.zeros(n, 1, dtype=torch.int64)
    out = [Generated() for _ in rows]
    logits = torch.empty(n, vocab)
    for step in range(max_tokens):
        if all(o.finish_reason for o in out):
            break
        for i, r in enumerate(rows):
            logits[i] = model(r.request, step)
        if mask.fill([None if o.finish_reason else s for o, s in zip(out, states, strict=True)]):
            apply_token_bitmask_(logits, mask.upload(n), backend=backend)
        if greedy:
            tokens = sampler.sample(logits, list(range(n)), [step] * n, token_pool, [None] * n)[0].tolist()
        else:
            tokens = [
                _seeded_draw(row_logits, r.request, step) for r, row_logits in zip(rows, logits, strict=True)
            ]
        for o, s, tok, row_logits in zip(out, states, tokens, logits, strict=True):
            if o.finish_reason:
                continue
            if keep_logits:
                o.masked_logits.append(row_logits.clone())
            o.token_ids.append(tok)
            if s is not None:
                s.accept(tok)
                if s.finished:
                    o.finish_reason = "stop"
            elif tok in eos:
                o.finish_reason = "stop"
            if not o.finish_reason and len(o.token_ids) >= max_tokens:
                o.finish_reason = "length"
    return out


def _seeded_draw(logits: torch.Tensor, request: int, step: int) -> int:
    """A draw from softmax(logits) by the Gumbel-max trick; u in [0, 1) keeps the noise finite or -inf."""
    g = torch.Generator().manual_seed(request * 7919 + step)
    u = torch.rand(logits.shape, generator=g)
    return int((logits - torch.log(-torch.log(u))).argmax())


def text_of(tokenizer, g: Generated) -> str:  # type: ignore[no-untyped-def]
    """The output text without its final stop token (the detokenizer skips special tokens alike)."""
    ids = g.token_ids[:-1] if g.finish_reason == "stop" else g.token_ids
    return tokenizer.decode(ids, skip_special_tokens=False)
