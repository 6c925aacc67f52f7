"""tool_choice "required" and named functions, enforced by grammar: random-logit generations constrained by
`tool_choice_constraint` parse back (tool_formats.parse_tool_calls) into calls of the allowed tools whose
arguments validate against the tools' schemas, in each family's format."""

from __future__ import annotations

import json

import jsonschema
import pytest
from kubesgl.errors import InvalidRequestError
from kubesgl.tool_formats import (
    LLAMA3,
    MISTRAL,
    QWEN25,
    function_tools,
    parse_tool_calls,
    tool_choice_constraint,
)
from support.grammar_helpers import Row, generate, terminating_random_logits, text_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 12},
                    "unit": {"enum": ["c", "f"]},
                    "days": {"type": "integer", "minimum": 1, "maximum": 7},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "maxLength": 20},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
                },
                "required": ["query"],
            },
        },
    },
    {"type": "function", "function": {"name": "now"}},  # no parameters: no arguments
]
SCHEMAS = {
    t["function"]["name"]: t["function"].get("parameters", {"type": "object", "properties": {}})
    for t in TOOLS
}
SCHEMAS["now"] = {"type": "object", "properties": {}, "additionalProperties": False}
FORMATS = [QWEN25, LLAMA3, MISTRAL]


def _calls(grammar_compiler, qwen_tokenizer, fmt, tool_choice, parallel=True, rows=3):  # type: ignore[no-untyped-def]
    constraint = tool_choice_constraint(fmt, TOOLS, tool_choice, parallel)
    model = terminating_random_logits(qwen_tokenizer, seed=11)
    outputs = generate(
        grammar_compiler, model, [Row(r, constraint) for r in range(rows)], greedy=False, max_tokens=500
    )
    parsed = []
    for g in outputs:
        text = text_of(qwen_tokenizer, g)
        assert g.finish_reason == "stop", text
        p = parse_tool_calls(text, fmt)
        assert p.content is None and p.tool_calls, text
        for c in p.tool_calls:
            jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
        parsed.append(p)
    return parsed


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_required_makes_at_least_one_valid_call_to_a_declared_tool(
    fmt, grammar_compiler, qwen_tokenizer
) -> None:  # type: ignore[no-untyped-def]
    parsed = _calls(grammar_compiler, qwen_tokenizer, fmt, "required")
    assert all({c.name for c in p.tool_calls} <= set(SCHEMAS) for p in parsed)


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_required_without_parallel_calls_makes_exactly_one(fmt, grammar_compiler, qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    assert all(
        len(p.tool_calls) == 1 for p in _calls(grammar_compiler, qwen_tokenizer, fmt, "required", False)
    )


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
@pytest.mark.parametrize("name", ["search", "now"])
def test_a_named_function_is_called_exactly_once(fmt, name, grammar_compiler, qwen_tokenizer) -> None:  # type: ignore[no-untyped-def]
    choice = {"type": "function", "function": {"name": name}}
    for p in _calls(grammar_compiler, qwen_tokenizer, fmt, choice, rows=2):
        assert [c.name for c in p.tool_calls] == [name]


def test_auto_and_none_need_no_grammar() -> None:
    assert tool_choice_constraint(QWEN25, TOOLS, "auto") is None
    assert tool_choice_constraint(QWEN25, TOOLS, "none") is None
    assert tool_choice_constraint(QWEN25, TOOLS, None) is None


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
        ([], "required", "tool_choice"),
        (TOOLS, "sometimes", "tool_choice"),
        ([{"type": "function", "function": {"name": "bad name!"}}], "required", "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": [1]}}],
            "required",
            "tools[0].function.parameters",
        ),
        ([{"type": "code_interpreter"}], "required", "tools[0]"),
        ([TOOLS[2], TOOLS[2]], "required", "tools[1].function.name"),
    ],
)
def test_bad_tools_or_tool_choice_are_400s_naming_the_field(tools, choice, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as err:
        tool_choice_constraint(QWEN25, tools, choice)
    assert err.value.param == param and err.value.status == 400


def test_a_tool_schema_xgrammar_cannot_compile_is_a_400(grammar_compiler) -> None:  # type: ignore[no-untyped-def]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "bogus"}}}]
    constraint = tool_choice_constraint(QWEN25, tools, "required")
    with pytest.raises(InvalidRequestError, match="bogus") as err:
        grammar_compiler.compile(constraint)
    assert err.value.param == "tool_choice"
    assert [t.name for t in function_tools(TOOLS)] == ["get_weather", "search", "now"]
