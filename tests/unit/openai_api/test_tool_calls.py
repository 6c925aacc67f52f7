"""Tool-call parsing (kubesgl.tool_formats) for the Qwen, Llama-3 and Mistral formats, whole and
streamed: every split of the text streams to exactly the whole parse, and no partial markup leaks."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kubesgl.tool_formats import (
    LLAMA3,
    MISTRAL,
    QWEN25,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    ToolCallStream,
    detect_tool_format,
    fold_deltas,
    new_call_id,
    parse_tool_calls,
)


def ids() -> Callable[[], str]:
    counter = itertools.count()
    return lambda: f"call_{next(counter):024x}"


def call(i: int, name: str, arguments: str) -> ToolCall:
    return ToolCall(f"call_{i:024x}", name, arguments)


W = '{"city": "Paris", "unit": "c"}'
TRICKY = '{"q": "a}b{\\"c\\"", "n": [1, {"z": [2, 3]}], "t": true, "none": null, "x": -1.5e3}'

CASES: list[tuple[ToolCallFormat, str, ParsedOutput]] = [
    # Qwen2.5 / Qwen3
    (
        QWEN25,
        f'<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
        ParsedOutput(None, (call(0, "get_weather", W),)),
    ),
    (
        QWEN25,
        f'<tool_call>\n{{"name": "a", "arguments": {W}}}\n</tool_call>\n<tool_call>\n{{"name": "b", "arguments": {TRICKY}}}\n</tool_call>',
        ParsedOutput(None, (call(0, "a", W), call(1, "b", TRICKY))),
    ),
    (
        QWEN25,
        f'Let me look that up.\n\n<tool_call>\n{{"name": "get_weather", "arguments": {W}}}\n</tool_call>',
        ParsedOutput("Let me look that up.", (call(0, "get_weather", W),)),
    ),
    (
        QWEN25,
        '<tool_call>{"arguments": {"x": 1}, "name": "late"}</tool_call>',
        ParsedOutput(None, (call(0, "late", '{"x": 1}'),)),
    ),
    (
        QWEN25,
        '<tool_call>\n{"name": "s", "arguments": "{\\"x\\": 1}"}\n</tool_call>',
        ParsedOutput(None, (call(0, "s", '{"x": 1}'),)),
    ),
    (QWEN25, '<tool_call>\n{"name": "noargs"}\n</tool_call>', ParsedOutput(None, (call(0, "noargs", "{}"),))),
    (
        QWEN25,
        f'<tool_call>{{"name": "a", "arguments": {W}}}</tool_call>\nDone.',
        ParsedOutput("Done.", (call(0, "a", W),)),
    ),
    (QWEN25, "a <tool_ b <tool_call", ParsedOutput("a <tool_ b <tool_call", ())),
    (QWEN25, "no calls at all\n", ParsedOutput("no calls at all\n", ())),
    # malformed: content, markup and all
    (
        QWEN25,
        '<tool_call>\n{"name": get_weather}\n</tool_call>',
        ParsedOutput('<tool_call>\n{"name": get_weather}\n</tool_call>', ()),
    ),
    (QWEN25, "x <tool_call>\nnot json</tool_call>", ParsedOutput("x <tool_call>\nnot json</tool_call>", ())),
    (
        QWEN25,
        '<tool_call>\n{"arguments": {}}</tool_call>',
        ParsedOutput('<tool_call>\n{"arguments": {}}</tool_call>', ()),
    ),
    (QWEN25, 'Hi <tool_call>\n{"na', ParsedOutput('Hi <tool_call>\n{"na', ())),
    (
        QWEN25,
        '<tool_call>{"name": 7, "arguments": {}}</tool_call>',
        ParsedOutput('<tool_call>{"name": 7, "arguments": {}}</tool_call>', ()),
    ),
    # Llama 3.x JSON
    (
        LLAMA3,
        '{"name": "get_weather", "parameters": ' + W + "}",
        ParsedOutput(None, (call(0, "get_weather", W),)),
    ),
    (LLAMA3, ' <|python_tag|>{"name": "f", "parameters": {}}', ParsedOutput(None, (call(0, "f", "{}"),))),
    (
        LLAMA3,
        'Sure.\n<|python_tag|>{"name": "f", "parameters": ' + TRICKY + "}",
        ParsedOutput("Sure.", (call(0, "f", TRICKY),)),
    ),
    (
        LLAMA3,
        '{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": [1]}}',
        ParsedOutput(None, (call(0, "a", "{}"), call(1, "b", '{"x": [1]}'))),
    ),
    (LLAMA3, '{"answer": 42}', ParsedOutput('{"answer": 42}', ())),
    (LLAMA3, "The set is {1, 2}.", ParsedOutput("The set is {1, 2}.", ())),
    (
        LLAMA3,
        '{"name": "f", "parameters": {"a": 1}',
        ParsedOutput(None, (call(0, "f", '{"a": 1}'),)),
    ),  # cut off: the call stands
    # Mistral
    (
        MISTRAL,
        '[TOOL_CALLS][{"name": "a", "arguments": ' + W + '}, {"name": "b", "arguments": {}}]',
        ParsedOutput(None, (call(0, "a", W), call(1, "b", "{}"))),
    ),
    (MISTRAL, '[{"name": "f", "arguments": ' + TRICKY + "}]", ParsedOutput(None, (call(0, "f", TRICKY),))),
    (
        MISTRAL,
        'Checking. [TOOL_CALLS] [{"name": "f", "arguments": {}}]',
        ParsedOutput("Checking.", (call(0, "f", "{}"),)),
    ),
    (MISTRAL, "[TOOL_CALLS] not json", ParsedOutput("[TOOL_CALLS] not json", ())),
    (MISTRAL, "[1, 2, 3] and [TOOL", ParsedOutput("[1, 2, 3] and [TOOL", ())),
    (MISTRAL, "[TOOL_CALLS][{]", ParsedOutput("[TOOL_CALLS][{]", ())),
]
CASE_IDS = [f"{fmt.name}-{i}" for i, (fmt, _, _) in enumerate(CASES)]


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_complete_outputs_parse_into_content_and_calls(fmt, text, expected) -> None:  # type: ignore[no-untyped-def]
    parsed = parse_tool_calls(text, fmt, ids())
    assert parsed == expected
    for c in parsed.tool_calls:  # every argument string these outputs carry is the JSON the model wrote
        json.loads(c.arguments)


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_streams_split_anywhere_reassemble_to_the_whole_parse(fmt, text, expected) -> None:  # type: ignore[no-untyped-def]
    for cut in range(len(text) + 1):
        stream = ToolCallStream(fmt, ids())
        deltas = [*stream.push(text[:cut]), *stream.push(text[cut:]), *stream.finish()]
        assert fold_deltas(deltas) == expected, cut
        assert stream.made_calls == bool(expected.tool_calls)
    stream = ToolCallStream(fmt, ids())
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    assert fold_deltas(deltas) == expected


@pytest.mark.parametrize(("fmt", "text", "expected"), CASES, ids=CASE_IDS)
def test_stream_deltas_have_openais_shape(fmt, text, expected) -> None:  # type: ignore[no-untyped-def]
    stream = ToolCallStream(fmt)  # real ids
    deltas = [d for ch in text for d in stream.push(ch)] + stream.finish()
    seen: set[int] = set()
    for d in deltas:
        assert set(d) in ({"content"}, {"tool_calls"}) and d.get("content", "x")
        for c in d.get("tool_calls", ()):
            if c["index"] not in seen:  # the first delta of a call: id, type, name, empty arguments
                assert c["index"] == len(seen)
                assert re.fullmatch(r"call_[0-9a-f]{24}", c["id"]) and c["type"] == "function"
                assert c["function"]["name"] and c["function"]["arguments"] == ""
                seen.add(c["index"])
            else:
                assert set(c) == {"index", "function"} and set(c["function"]) == {"arguments"}
    assert len(seen) == len(expected.tool_calls)


def test_streamed_content_never_shows_partial_markup() -> None:
    text = f'Let me check.\n<tool_call>\n{{"name": "f", "arguments": {W}}}\n</tool_call>'
    stream = ToolCallStream(QWEN25)
    content = ""
    for ch in text:
        for d in stream.push(ch):
            content += d.get("content", "")
            assert "<" not in content and not content.endswith("\n")
    assert content == "Let me check."


def test_arguments_stream_as_they_are_written() -> None:
    stream = ToolCallStream(QWEN25, ids())
    assert stream.push('<tool_call>\n{"name": "f", "arguments": {"city": "Par') == [
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": f"call_{0:024x}",
                    "type": "function",
                    "function": {"name": "f", "arguments": ""},
                }
            ]
        },
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Par'}}]},
    ]
    assert stream.push('is"}}\n</tool') == [{"tool_calls": [{"index": 0, "function": {"arguments": 'is"}'}}]}]
    assert stream.push("_call>") == [] and stream.finish() == []


def test_finish_reason_is_tool_calls_only_when_calls_were_made_and_the_output_ended() -> None:
    made = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}</tool_call>', QWEN25)
    assert made.finish_reason("stop") == "tool_calls" and made.finish_reason("length") == "length"
    assert parse_tool_calls("plain", QWEN25).finish_reason("stop") == "stop"
    assert made.tool_calls[0].to_openai()["function"] == {"name": "f", "arguments": "{}"}
    assert re.fullmatch(r"call_[0-9a-f]{24}", new_call_id())


def test_the_format_is_read_from_the_chat_template(qwen_tokenizer_dir: str) -> None:
    from transformers import AutoTokenizer

    assert detect_tool_format(AutoTokenizer.from_pretrained(qwen_tokenizer_dir).chat_template) is QWEN25
    assert detect_tool_format("{{ '<|python_tag|>' }}") is LLAMA3
    assert detect_tool_format("{%- if message.role == 'ipython' %}{{ '\"parameters\": ' }}") is LLAMA3
    assert detect_tool_format("{{ '[TOOL_CALLS]' }}") is MISTRAL
    assert detect_tool_format("no tools", frozenset({"[TOOL_CALLS]"})) is MISTRAL
    assert detect_tool_format("{{ messages }}") is None and detect_tool_format(None) is None


_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "<tool_",
    "<|python_tag|>",
    "[TOOL_CALLS]",
    "[",
    "]",
    "{",
    "}",
    '"name"',
    '"arguments"',
    '"parameters"',
    ":",
    ",",
    ";",
    " ",
    "\n",
    '"f"',
    '"a\\"}"',
    "1",
    "null",
    "text",
    "\\",
]


@given(pieces=st.lists(st.sampled_from(_PIECES), max_size=30), cut=st.integers(0, 400))
@settings(max_examples=300, derandomize=True, deadline=None, database=None)
def test_any_text_parses_and_streams_consistently(pieces: list[str], cut: int) -> None:
    text = "".join(pieces)
    for fmt in (QWEN25, LLAMA3, MISTRAL):
        whole = parse_tool_calls(text, fmt, ids())
        stream = ToolCallStream(fmt, ids())
        split = [*stream.push(text[:cut]), *stream.push(text[cut:]), *stream.finish()]
        assert fold_deltas(split) == whole
        if not whole.tool_calls:  # nothing was a call: all the text is content, not a character lost
            assert whole.content == text
