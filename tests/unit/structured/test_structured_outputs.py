"""Grammar-constrained decoding (kubesgl.structured) on CPU with the real Qwen3 tokenizer: random-logit
generations through our masking and sampler satisfy their JSON schema / regex / EBNF; unconstrained rows
are untouched by a constrained neighbour; bad constraints are 400s naming the field."""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest
import torch
from kubesgl.errors import InvalidRequestError
from kubesgl.protocol import GenerateRequest
from kubesgl.structured.bitmask import allowed_tokens, apply_token_bitmask_
from kubesgl.structured.compiler import GrammarCompiler
from kubesgl.structured.constraint import Constraint, check_constraint
from kubesgl.structured.matcher import GrammarRejectedToken, GrammarState, TokenBitmask
from kubesgl.values.sampling import SamplingParams
from support.grammar_helpers import (
    QWEN3_EOS,
    QWEN3_VOCAB,
    RandomLogits,
    Row,
    generate,
    terminating_random_logits,
    text_of,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tokenizer(qwen_tokenizer):  # type: ignore[no-untyped-def]
    return qwen_tokenizer


@pytest.fixture(scope="module")
def compiler(grammar_compiler) -> GrammarCompiler:  # type: ignore[no-untyped-def]
    return grammar_compiler


@pytest.fixture(scope="module")
def model(tokenizer) -> RandomLogits:  # type: ignore[no-untyped-def]
    return terminating_random_logits(tokenizer, seed=7)


SCHEMAS: dict[str, dict] = {
    "flat_required": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "enums_and_bools": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "shade": {"type": "string", "enum": ["light", "dark"]},
            "ok": {"type": "boolean"},
            "nothing": {"type": "null"},
            "version": {"const": 3},
        },
        "required": ["colour", "ok", "version"],
    },
    "arrays": {
        "type": "object",
        "properties": {
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 4},
            "scores": {
                "type": "array",
                "items": {"type": "integer", "minimum": -5, "maximum": 5},
                "maxItems": 3,
            },
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "boolean"}, {"type": "integer"}],
                "items": False,
            },
        },
        "required": ["tags", "scores", "pair"],
    },
    "bounded_numbers": {
        "type": "object",
        "properties": {
            "ratio": {"type": "number", "minimum": 0, "maximum": 1},
            "temp": {"type": "number", "exclusiveMinimum": -40, "exclusiveMaximum": 60},
            "count": {"type": "integer", "minimum": 10, "maximum": 99},
        },
        "required": ["ratio", "temp", "count"],
    },
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                    "address": {
                        "type": "object",
                        "properties": {
                            "city": {"type": "string", "minLength": 1, "maxLength": 8},
                            "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                        },
                        "required": ["city", "zip"],
                    },
                },
                "required": ["id", "address"],
            },
            "active": {"type": "boolean"},
        },
        "required": ["user", "active"],
    },
    "refs_and_unions": {
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            }
        },
        "type": "object",
        "properties": {
            "a": {"$ref": "#/$defs/point"},
            "b": {"anyOf": [{"$ref": "#/$defs/point"}, {"type": "null"}]},
            "label": {"type": ["string", "null"], "maxLength": 6},
        },
        "required": ["a", "b", "label"],
    },
    "free_string": {
        "type": "object",
        "properties": {"note": {"type": "string"}, "n": {"type": "integer"}},
        "required": ["note", "n"],
    },
    "top_level_array": {
        "type": "array",
        "items": {"type": "integer", "minimum": 0, "maximum": 9},
        "minItems": 2,
        "maxItems": 5,
    },
}


@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_parse_and_validate(name, greedy, compiler, model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    schema = SCHEMAS[name]
    rows = [Row(r, Constraint.json_schema(schema)) for r in range(4)]
    for g in generate(compiler, model, rows, greedy=greedy, max_tokens=400):
        text = text_of(tokenizer, g)
        assert g.finish_reason == "stop", text
        value = json.loads(text)  # strict: control characters inside strings would fail here
        jsonschema.validate(value, schema)


def test_json_object_outputs_are_json_objects(compiler, model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = [Row(r, Constraint("json_object")) for r in range(6)]
    for g in generate(compiler, model, rows, greedy=False, max_tokens=1000):
        assert g.finish_reason == "stop"
        assert isinstance(json.loads(text_of(tokenizer, g)), dict)


REGEXES = [
    r"[a-z]{3,8}@(example|test)\.(com|org)",
    r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])",
    r"(yes|no|maybe)",
    r"\(\d{3}\) \d{3}-\d{4}",
    r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){0,2}\.",
]


@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_outputs_fullmatch(pattern, compiler, model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = [Row(r, Constraint("regex", pattern, param="regex")) for r in range(4)]
    for greedy in (True, False):
        for g in generate(compiler, model, rows, greedy=greedy, max_tokens=100):
            assert g.finish_reason == "stop"
            assert re.fullmatch(pattern, text_of(tokenizer, g)), text_of(tokenizer, g)


ARITHMETIC = r"""
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= number | "(" expr ")"
number ::= [0-9] | [1-9] [0-9]
"""


def _parses_as_arithmetic(text: str) -> bool:
    """A recognizer for ARITHMETIC, written independently of xgrammar."""
    pos = 0

    def number() -> bool:
        nonlocal pos
        m = re.compile(r"[1-9][0-9]|[0-9]").match(text, pos)
        if not m:
            return False
        pos = m.end()
        return True

    def factor() -> bool:
        nonlocal pos
        if text.startswith("(", pos):
            pos += 1
            if not expr() or not text.startswith(")", pos):
                return False
            pos += 1
            return True
        return number()

    def chain(item, ops: str) -> bool:  # type: ignore[no-untyped-def]
        nonlocal pos
        if not item():
            return False
        while pos < len(text) and text[pos] in ops:
            pos += 1
            if not item():
                return False
        return True

    def term() -> bool:
        return chain(factor, "*/")

    def expr() -> bool:
        return chain(term, "+-")

    return expr() and pos == len(text)


def test_ebnf_outputs_parse(compiler, model, tokenizer) -> None:  # type: ignore[no-untyped-def]
    rows = [Row(r, Constraint("ebnf", ARITHMETIC, param="ebnf")) for r in range(6)]
    outputs = generate(compiler, model, rows, greedy=False, max_tokens=200)
    for g in outputs:
        assert g.finish_reason == "stop"
        assert _parses_as_arithmetic(text_of(tokenizer, g)), text_of(tokenizer, g)
    assert any("(" in text_of(tokenizer, g) or len(text_of(tokenizer, g)) > 3 for g in outputs)


@pytest.mark.parametrize("backend", ["cpu", "torch", "triton"])
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_unconstrained_rows_are_bit_identical_beside_a_constrained_row(
    greedy, backend, compiler, model
) -> None:  # type: ignore[no-untyped-def]
    steps = 6 if backend == "triton" else 24  # the Triton interpreter is slow on 152k-wide rows
    alone = generate(compiler, model, [Row(0), Row(1)], greedy=greedy, max_tokens=steps, keep_logits=True)
    schema = Constraint.json_schema(SCHEMAS["nested"])
    mixed = generate(
        compiler,
        model,
        [Row(0), Row(5, schema), Row(1)],
        greedy=greedy,
        max_tokens=steps,
        backend=backend,
        keep_logits=True,
    )
    for a, m in zip(alone, (mixed[0], mixed[2]), strict=True):
        assert a.token_ids == m.token_ids
        assert all(torch.equal(x, y) for x, y in zip(a.masked_logits, m.masked_logits, strict=True))
    # The constrained row really was masked (most of the vocabulary is -inf at every step).
    assert all(torch.isinf(lg).float().mean() > 0.5 for lg in mixed[1].masked_logits)


INVALID = [
    (Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": "bogus"}}}'), "bogus"),
    (Constraint("json_schema", '{"type": "integer", "minimum": 5, "maximum": 1}'), "minimum"),
    (Constraint("json_schema", '{"$ref": "#/$defs/missing"}'), "$defs"),
    (Constraint("json_schema", '{"type": "string", "pattern": "(unclosed"}'), "parenthesis"),
    (Constraint("regex", "(abc", param="regex"), "parenthesis"),
    (Constraint("regex", "a(?=b)", param="regex"), "Lookahead"),
    (Constraint("ebnf", 'root ::= "a" | ', param="ebnf"), "Expect element"),
    (Constraint("ebnf", 'start ::= "a"', param="ebnf"), "root"),
    (
        Constraint("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}', param="tools"),
        "nope",
    ),
]


@pytest.mark.parametrize(
    ("constraint", "why"), INVALID, ids=[f"{c.kind}-{i}" for i, (c, _) in enumerate(INVALID)]
)
def test_an_uncompilable_constraint_is_a_400_naming_the_field(constraint, why, compiler) -> None:  # type: ignore[no-untyped-def]
    for attempt in (lambda: check_constraint(constraint), lambda: compiler.compile(constraint)):
        with pytest.raises(InvalidRequestError) as err:
            attempt()
        assert err.value.status == 400
        assert err.value.param == constraint.param
        assert why in err.value.message and err.value.message.startswith(f"{constraint.param}: ")
        assert "/project/cpp" not in err.value.message  # xgrammar's source paths are not shown


def test_constraint_values_are_checked_where_they_are_built() -> None:
    with pytest.raises(InvalidRequestError, match="not valid JSON") as err:
        Constraint.json_schema('{"type": ', param="response_format.json_schema.schema")
    assert err.value.param == "response_format.json_schema.schema"
    with pytest.raises(InvalidRequestError, match="object or a boolean"):
        Constraint.json_schema("[1, 2]")
    with pytest.raises(InvalidRequestError, match="empty"):
        Constraint("regex", "", param="regex")
    with pytest.raises(InvalidRequestError, match="unknown constraint kind"):
        Constraint("yaml", "a: 1")  # type: ignore[arg-type]
    c = Constraint.json_schema({"b": 1, "a": 2, "type": "object"}, param="x")
    assert c.source == '{"b":1,"a":2,"type":"object"}'  # key order kept: it is the output's order
    wire = GenerateRequest("r", "gw", [1], SamplingParams(constraint=c), 0.0).to_bytes()
    back = GenerateRequest.from_bytes(wire).sampling.constraint
    assert back == c and back is not None and back.param == "x"  # the wire carries the field it came from


def test_each_distinct_constraint_compiles_once_even_when_asked_concurrently(tokenizer) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler.for_tokenizer(tokenizer, QWEN3_VOCAB, QWEN3_EOS)
    try:
        schema = Constraint.json_schema({"type": "object", "properties": {"k": {"type": "integer"}}})
        results: list = []
        threads = [
            threading.Thread(target=lambda: results.append(compiler.compile(schema))) for _ in range(6)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 6 and all(r is results[0] for r in results)
        same_elsewhere = Constraint("json_schema", schema.source, param="tools[0].function.parameters")
        assert compiler.submit(same_elsewhere).result(60) is results[0]
        info = compiler.cache_info()
        assert (info.misses, info.entries) == (1, 1) and info.hits >= 1 and info.bytes > 0
        other = compiler.submit(Constraint("regex", "[ab]+", param="regex")).result(60)
        assert other.constraint.kind == "regex" and compiler.cache_info().entries == 2
    finally:
        compiler.close()


def test_the_cache_evicts_least_recently_used_beyond_its_byte_budget(tokenizer) -> None:  # type: ignore[no-untyped-def]
    compiler = GrammarCompiler.for_tokenizer(tokenizer, QWEN3_VOCAB, QWEN3_EOS, cache_bytes=1)
    try:
        a, b = Constraint("regex", "a+", param="regex"), Constraint("regex", "b+", param="regex")
        first = compiler.compile(a)
        compiler.compile(b)
        assert compiler.cache_info().entries == 1  # over budget: only the newest stays
        assert compiler.compile(a) is not first and compiler.cache_info().misses == 3
    finally:
        compiler.close()


def _allowed(state: GrammarState) -> set[int]:
    mask = TokenBitmask(1, QWEN3_VOCAB, torch.device("cpu"))
    mask.fill([state])
    return set(allowed_tokens(mask.upload(1)[0], QWEN3_VOCAB).nonzero().flatten().tolist())


def test_a_complete_grammar_allows_only_stop_tokens_and_ends_on_one(compiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    state = GrammarState(compiler.compile(Constraint("regex", "(yes|no)", param="regex")))
    assert not state.complete and tokenizer.encode("yes")[0] in _allowed(state)
    state.accept_all(tokenizer.encode("yes"))
    assert state.complete and not state.finished
    assert _allowed(state) == set(QWEN3_EOS)
    with pytest.raises(GrammarRejectedToken, match="not allowed"):
        state.accept(tokenizer.encode("x")[0])
    state.accept(QWEN3_EOS[0])
    assert state.finished
    # A request's own stop_token_ids replace the model's EOS as the way out.
    custom = GrammarState(
        compiler.compile(Constraint("regex", "(yes|no)", param="regex")), stop_token_ids=[42]
    )
    custom.accept_all(tokenizer.encode("no"))
    assert _allowed(custom) == {42}


@pytest.mark.parametrize("bounds", [{}, {"maxLength": 8}, {"minLength": 1, "maxLength": 3}])
def test_json_strings_never_allow_raw_control_characters(bounds, compiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    # xgrammar's own length-bounded strings allow them (strict JSON parsers then fail): compiler.py fixes it.
    schema = {"type": "object", "properties": {"s": {"type": "string", **bounds}}, "required": ["s"]}
    state = GrammarState(compiler.compile(Constraint.json_schema(schema)))
    state.accept_all(tokenizer.encode('{"s": "'))
    allowed = _allowed(state)
    controls = {t for ch in ("\t", "\x01", "\x1f", "\x04") for t in tokenizer.encode(ch)}
    assert len(controls) == 4 and not allowed & controls
    assert set(tokenizer.encode("a")) <= allowed


def test_special_and_padding_tokens_are_never_allowed(compiler) -> None:  # type: ignore[no-untyped-def]
    allowed = _allowed(GrammarState(compiler.compile(Constraint("json_object"))))
    assert not allowed & set(range(151643, 151657))  # <|endoftext|>, <|im_start|>, <|im_end|>, ...
    assert not allowed & set(range(151669, QWEN3_VOCAB))  # the model's padded rows past the tokenizer


def test_rollback_restores_the_earlier_mask(compiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    state = GrammarState(compiler.compile(Constraint.json_schema(SCHEMAS["flat_required"])))
    state.accept_all(tokenizer.encode('{"name": "'))
    before = _allowed(state)
    state.accept_all(tokenizer.encode('bob", '))
    assert _allowed(state) != before
    state.rollback(len(tokenizer.encode('bob", ')))
    assert _allowed(state) == before
    with pytest.raises(ValueError):
        state.rollback(state.num_accepted + 1)
    assert (
        GrammarState(compiler.compile(Constraint.json_schema(SCHEMAS["flat_required"]))).jump_forward() == "{"
    )


def test_batch_mask_rows_of_unconstrained_and_finished_requests_allow_everything(compiler, tokenizer) -> None:  # type: ignore[no-untyped-def]
    done = GrammarState(compiler.compile(Constraint("regex", "a", param="regex")))
    done.accept_all([*tokenizer.encode("a"), QWEN3_EOS[0]])
    live = GrammarState(compiler.compile(Constraint("regex", "[0-9]+", param="regex")))
    mask = TokenBitmask(4, QWEN3_VOCAB, torch.device("cpu"))
    assert mask.fill([None, live, done, live])
    rows = mask.upload(4)
    assert bool((rows[[0, 2]] == -1).all())
    assert torch.equal(rows[1], rows[3]) and not bool((rows[1] == -1).all())
    assert not mask.fill([None, done])


def _random_bitmask(rows: int, vocab: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = torch.randint(-(2**31), 2**31, (rows, (vocab + 31) // 32), generator=g, dtype=torch.int64)
    words[0] = -1  # an unconstrained row
    return words.to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [None, [1, 3]], ids=["all-rows", "some-rows"])
def test_masking_backends_agree_with_the_definition(dtype, rows) -> None:  # type: ignore[no-untyped-def]
    vocab = 5000 + 17  # not a multiple of 32: the last word is partly padding
    mask = _random_bitmask(4, vocab, seed=3)
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(4)).to(dtype)
    allowed = torch.stack([allowed_tokens(mask[i], vocab) for i in range(4)])
    picked = torch.zeros(4, dtype=torch.bool)
    picked[rows if rows is not None else slice(None)] = True
    expected = torch.where(allowed | ~picked[:, None], logits, torch.tensor(float("-inf"), dtype=dtype))
    for backend in ("torch", "cpu", "triton"):
        got = apply_token_bitmask_(logits.clone(), mask, rows, backend=backend)
        assert torch.equal(got, expected), backend


def test_seeded_engine_sampling_never_picks_a_masked_token() -> None:
    from kubesgl.engine.plan import SlotInit
    from kubesgl.engine.sampler import Sampler
    from kubesgl.values.sampling import SamplingParams

    # seed 11 at position 71 draws u == 1.0 for token 99656 (found by scanning seeded_uniform).
    banned = 99656
    mask = torch.full((1, (QWEN3_VOCAB + 31) // 32), -1, dtype=torch.int32)
    mask[0, banned // 32] &= ~(1 << (banned % 32))
    logits = apply_token_bitmask_(torch.zeros(1, QWEN3_VOCAB), mask)
    sampler = Sampler(1, torch.device("cpu"))
    sampler.init_slots([SlotInit(0, 0, SamplingParams(temperature=1.0, seed=11), 11)])
    token = sampler.sample(logits, [0], [71], torch.zeros(1, 1, dtype=torch.int64), [None])[0]
    assert int(token) != banned


def test_seeded_noise_stays_inside_zero_one_and_zero_noise_never_picks_a_zero_probability() -> None:
    # The bug above: seeded_uniform could round to exactly 1.0 (zero noise), and 0 / 0 = NaN won the race.
    from kubesgl.engine.sampler import exponential_race, seeded_uniform

    seeds = torch.arange(64, dtype=torch.int64) * 0x9E3779B97F4A7C15 % 2**63
    u = seeded_uniform(seeds, torch.arange(64, dtype=torch.int64) * 131, QWEN3_VOCAB)
    assert float(u.min()) > 0.0 and float(u.max()) < 1.0
    probs = torch.tensor([[0.0, 0.3, 0.7], [0.5, 0.0, 0.5]])
    noise = torch.tensor([[0.0, 1.0, 1.0], [1.0, 0.0, 2.0]])  # a zero draw on a zero-probability token
    assert exponential_race(probs, noise).tolist() == [2, 0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_masking_on_cuda_matches_torch_and_runs_in_a_cuda_graph() -> None:
    vocab, b = QWEN3_VOCAB, 64
    mask = _random_bitmask(b, vocab, seed=5).cuda()
    logits = torch.randn(b, vocab, device="cuda", dtype=torch.bfloat16)
    expected = apply_token_bitmask_(logits.clone(), mask, backend="torch")
    assert torch.equal(apply_token_bitmask_(logits.clone(), mask, backend="triton"), expected)
    rows = torch.tensor([3, 9, 40], device="cuda")
    assert torch.equal(
        apply_token_bitmask_(logits.clone(), mask, rows, backend="triton"),
        apply_token_bitmask_(logits.clone(), mask, rows, backend="torch"),
    )
    static = logits.clone()
    apply_token_bitmask_(static.clone(), mask, backend="triton")  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask_(static, mask, backend="triton")
    static.copy_(logits)
    graph.replay()
    assert torch.equal(static, expected)
