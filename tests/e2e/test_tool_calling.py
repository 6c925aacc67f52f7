"""Tool calling end to end (issue 13): `tools`, `tool_choice`, `parallel_tool_calls`, tool-role and assistant
tool_calls messages, `name`. The request checks (400s naming the field); the tokenizer rendering the tools with
each family's own chat template (Qwen3's real one, the Llama-3 and Mistral ones in tests/data) and choosing the
grammar for `tool_choice`; the gateway's chat encoder turning each family's output text into OpenAI
`tool_calls`, whole and streamed; and the real stack (demo model) serving it, with tool_choice "required" and a
named function enforced by the grammar on random weights.

Random weights never write a call unprompted, so parsing and streaming are pinned on the gateway's encoder fed
known output text (the encoder is the code under test, nothing is faked), and enforcement on the real engine."""

from __future__ import annotations

import json
import random
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from kubesgl.errors import InvalidRequestError
from kubesgl.launcher import Stack
from kubesgl.models.random_init import TOKENIZER_FILES
from kubesgl.openai_api.generation_spec import chat_spec
from kubesgl.openai_api.prompt_inputs import chat_messages
from kubesgl.openai_api.request_models import ChatCompletionRequest
from kubesgl.openai_api.responses import ChoiceResult
from kubesgl.protocol import ChatToolCall, PromptKind, TokenizeRequest
from kubesgl.services.gateway.encoders import ChatEncoder
from kubesgl.services.gateway.generation import ChoiceEvent
from kubesgl.services.tokenizer.prompt import model_tool_format, prompt_ids, tool_format_for, tool_sampling
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.tool_formats import LLAMA3, MISTRAL, QWEN25, ToolCallFormat
from kubesgl.values.constraint import Constraint
from kubesgl.values.outputs import FinishReason
from kubesgl.values.sampling import SamplingParams
from pydantic import ValidationError
from support.model_helpers import with_chat_template

WEATHER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
# Bounded output under a grammar (an enum and a small integer), so random weights finish a call in few tokens.
FORECAST_SCHEMA = {
    "type": "object",
    "properties": {"unit": {"enum": ["c", "f"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["unit", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_SCHEMA},
    },
    {"type": "function", "function": {"name": "get_forecast", "parameters": FORECAST_SCHEMA}},
]
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": '{"temp_c": 21}'},
    {"role": "user", "content": "And the forecast?"},
]
CALL_ID = re.compile(r"call_[0-9a-f]{24}")


def _request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": HISTORY, **fields})


# --- the request: accepted shapes, and a 400 naming the field for the rest --------------------------------------


def test_tools_default_to_auto_and_history_reaches_the_template_normalized() -> None:
    use = chat_spec(_request(tools=TOOLS)).tool_use
    assert (use.choice, use.parallel, [t["function"]["name"] for t in use.tools]) == (
        "auto",
        True,
        ["get_weather", "get_forecast"],
    )
    assert chat_spec(_request()).tool_use.choice == "none"
    msgs = chat_messages(_request().messages)
    assert msgs[1].name == "ann"
    assert msgs[2].content == "" and msgs[2].tool_calls == (
        ChatToolCall("get_weather", {"city": "Paris"}, "call_0123456789abcdef01234567"),
    )
    # A tool result names its call, and the template gets the function's name too.
    assert (msgs[3].role, msgs[3].tool_call_id, msgs[3].name) == (
        "tool",
        "call_0123456789abcdef01234567",
        "get_weather",
    )


def _bad_tool(**function: Any) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", **function}}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
        ({"tools": _bad_tool(name="has space")}, "tools[0].function.name"),
        ({"tools": _bad_tool(name="x" * 65)}, "tools[0].function.name"),
        ({"tools": _bad_tool(parameters=["not", "a", "schema"])}, "tools[0].function.parameters"),
        ({"tools": [*_bad_tool(), *_bad_tool()]}, "tools[1].function.name"),
        (
            {
                "tools": _bad_tool(parameters={"type": "object", "properties": {"a": {"type": "nope"}}}),
                "tool_choice": "required",
            },
            "tools[0].function.parameters",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tool_choice": "auto"}, "tool_choice"),
        ({"tools": TOOLS, "parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)
def test_bad_tool_fields_are_400s_naming_the_field(fields: dict[str, Any], param: str) -> None:
    with pytest.raises((InvalidRequestError, ValidationError)) as info:
        chat_spec(_request(**fields))
    err = info.value
    got = err.param if isinstance(err, InvalidRequestError) else ".".join(map(str, err.errors()[0]["loc"]))
    assert got == param


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([HISTORY[1], {"role": "tool", "content": "1"}], "messages[1].tool_call_id"),
        (
            [HISTORY[1], {"role": "tool", "tool_call_id": "call_unknown", "content": "1"}],
            "messages[1].tool_call_id",
        ),
        (
            [
                {
                    **HISTORY[2],
                    "tool_calls": [
                        {**HISTORY[2]["tool_calls"][0], "function": {"name": "f", "arguments": "{"}}
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [
                {
                    **HISTORY[2],
                    "tool_calls": [
                        {
                            **HISTORY[2]["tool_calls"][0],
                            "function": {"name": "f", "arguments": '{"a": 1e999}'},
                        }
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments.a",  # infinite: the wire cannot carry it
        ),
        (
            [
                {
                    **HISTORY[2],
                    "tool_calls": [
                        {
                            **HISTORY[2]["tool_calls"][0],
                            "function": {"name": "f", "arguments": '{"a": 99999999999999999999}'},
                        }
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments.a",
        ),
    ],
)
def test_bad_tool_messages_are_400s_naming_the_field(messages: list[dict[str, Any]], param: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        chat_messages(ChatCompletionRequest.model_validate({"model": "m", "messages": messages}).messages)
    assert info.value.param == param


# --- the tokenizer: each family's template renders the tools; tool_choice picks the grammar -------------------

FAMILIES = {"qwen": QWEN25, "llama3_json_tools.jinja": LLAMA3, "mistral_tools.jinja": MISTRAL}


@pytest.fixture(scope="module")
def family_tokenizers(
    qwen_tokenizer_dir: str, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, ModelTokenizer]:
    """The real Qwen3 tokenizer with each family's chat template in its tokenizer_config."""
    out = {}
    for template in FAMILIES:
        d = tmp_path_factory.mktemp("tok")
        for name in TOKENIZER_FILES:
            shutil.copyfile(Path(qwen_tokenizer_dir) / name, d / name)
        if template != "qwen":
            with_chat_template(d, template)
        out[template] = ModelTokenizer.load(str(d))
    return out


def _tokenize_request(**fields: Any) -> TokenizeRequest:
    req = _request(**fields)
    spec = chat_spec(req)
    return TokenizeRequest(
        rid="r",
        gateway_id="g",
        model="m",
        kind=PromptKind.CHAT,
        sampling=spec.params,
        deadline=0.0,
        messages=chat_messages(req.messages),
        tools=spec.tool_use.tools,
        tool_choice=spec.tool_use.choice,
        parallel_tool_calls=spec.tool_use.parallel,
    )


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_each_familys_template_renders_the_tools_unless_tool_choice_is_none(
    template: str, family_tokenizers: dict[str, ModelTokenizer]
) -> None:
    tok = family_tokenizers[template]
    fmt = model_tool_format(tok)
    assert fmt is FAMILIES[template]

    def rendered(**fields: Any) -> str:
        return tok.hf.decode(prompt_ids(_tokenize_request(**fields), tok), skip_special_tokens=False)

    with_tools = rendered(tools=TOOLS)
    assert "get_forecast" in with_tools and '"days"' in with_tools  # the definitions, schema and all
    assert "temp_c" in with_tools and "Paris" in with_tools  # the history's call and its result
    none = rendered(tools=TOOLS, tool_choice="none")
    assert "get_forecast" not in none and "temp_c" in none
    assert none == rendered()  # "none": the prompt is the one without tools
    assert tool_format_for(_tokenize_request(tools=TOOLS), fmt) is fmt
    assert tool_format_for(_tokenize_request(tools=TOOLS, tool_choice="none"), fmt) is None


@pytest.mark.parametrize("template", sorted(FAMILIES))
def test_tool_choice_required_and_named_become_the_familys_grammar(
    template: str, family_tokenizers: dict[str, ModelTokenizer]
) -> None:
    fmt = model_tool_format(family_tokenizers[template])
    assert tool_sampling(_tokenize_request(tools=TOOLS), fmt).constraint is None  # auto: nothing enforced
    required = tool_sampling(_tokenize_request(tools=TOOLS, tool_choice="required"), fmt).constraint
    named = {"type": "function", "function": {"name": "get_forecast"}}
    one = tool_sampling(_tokenize_request(tools=TOOLS, tool_choice=named), fmt).constraint
    assert required is not None and one is not None
    assert (required.kind, required.param, one.kind) == ("structural_tag", "tool_choice", "structural_tag")
    assert "get_weather" in required.source and "get_forecast" in required.source
    assert "get_weather" not in one.source and "get_forecast" in one.source
    # A structured response_format already constrains the output: the two cannot both hold.
    clash = _tokenize_request(tools=TOOLS, tool_choice="required")
    clash = TokenizeRequest(
        **{**clash.__dict__, "sampling": SamplingParams(constraint=Constraint("json_object"))}
    )
    with pytest.raises(InvalidRequestError) as info:
        tool_sampling(clash, fmt)
    assert info.value.param == "tool_choice"


def test_a_template_without_tool_markup_refuses_tools_with_a_400(
    qwen_tokenizer_dir: str, tmp_path: Path
) -> None:
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(qwen_tokenizer_dir) / name, tmp_path / name)
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    tok = ModelTokenizer.load(str(with_chat_template(tmp_path, plain)))
    assert model_tool_format(tok) is None
    with pytest.raises(InvalidRequestError) as info:
        tool_format_for(_tokenize_request(tools=TOOLS), None)
    assert info.value.param == "tools"
    assert tool_format_for(_tokenize_request(tools=TOOLS, tool_choice="none"), None) is None


# --- the gateway's chat encoder over each family's output text ---------------------------------------------------

# Two calls in each family's format, as the detokenizer hands them over (special tokens such as Llama's
# <|python_tag|> and Mistral's [TOOL_CALLS] are dropped by the decode, so those formats start bare).
OUTPUTS: dict[str, tuple[ToolCallFormat, str, str | None]] = {
    "qwen25": (
        QWEN25,
        'Checking both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_forecast", "arguments": {"unit": "f", "days": 3}}\n</tool_call>',
        "Checking both.",
    ),
    "llama3": (
        LLAMA3,
        '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}; '
        '{"name": "get_forecast", "parameters": {"unit": "f", "days": 3}}',
        None,
    ),
    "mistral": (
        MISTRAL,
        '[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}, '
        '{"name": "get_forecast", "arguments": {"unit": "f", "days": 3}}]',
        None,
    ),
}
EXPECTED_CALLS = [("get_weather", {"city": "Paris", "unit": "c"}), ("get_forecast", {"unit": "f", "days": 3})]


def _pieces(text: str, seed: int) -> list[str]:
    """`text` cut at random points, 1-4 characters apart (a detokenizer's deltas)."""
    rng, out, i = random.Random(seed), [], 0
    while i < len(text):
        step = rng.randint(1, 4)
        out.append(text[i : i + step])
        i += step
    return out


def _stream(
    fmt: ToolCallFormat, pieces: list[str], reason: FinishReason, parallel: bool = True
) -> list[dict]:
    enc = ChatEncoder("chatcmpl-x", "m", 1, False, lambda _: fmt, parallel)
    chunks = enc.prelude()
    for k, piece in enumerate(pieces):
        last = k == len(pieces) - 1
        chunks += enc.chunks(ChoiceEvent(0, piece, [k], None, finish_reason=reason if last else None))
    return chunks


def _whole(fmt: ToolCallFormat | None, text: str, reason: FinishReason, parallel: bool = True) -> dict:
    enc = ChatEncoder("chatcmpl-x", "m", 1, False, lambda _: fmt, parallel)
    return enc.final([ChoiceResult(0, text, reason)])["choices"][0]


def _fold(chunks: list[dict]) -> tuple[str, list[dict[str, Any]], list[str | None]]:
    """A stream's content, its calls (id, name, argument pieces) and every chunk's finish_reason."""
    content, calls, reasons = "", {}, []
    for chunk in chunks:
        (choice,) = chunk["choices"]
        reasons.append(choice["finish_reason"])
        delta = choice["delta"]
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", ()):
            if tc["index"] not in calls:  # its first delta: id, type and name
                assert CALL_ID.fullmatch(tc["id"]) and tc["type"] == "function" and tc["function"]["name"]
                calls[tc["index"]] = {"id": tc["id"], "name": tc["function"]["name"], "pieces": []}
            else:  # then only arguments
                assert set(tc) == {"index", "function"} and set(tc["function"]) == {"arguments"}
            calls[tc["index"]]["pieces"].append(tc["function"]["arguments"])
    return content, [calls[i] for i in sorted(calls)], reasons


@pytest.mark.parametrize("family", sorted(OUTPUTS))
@pytest.mark.parametrize("seed", range(5))
def test_each_familys_calls_stream_as_openai_deltas_and_match_the_whole_answer(
    family: str, seed: int
) -> None:
    fmt, text, content = OUTPUTS[family]
    content_streamed, calls, reasons = _fold(_stream(fmt, _pieces(text, seed), FinishReason.STOP))
    assert content_streamed == (content or "")
    for markup in ("<tool_call>", "</tool_call>", '"name"', "[{", "}]"):
        assert markup not in content_streamed
    assert [(c["name"], json.loads("".join(c["pieces"]))) for c in calls] == EXPECTED_CALLS
    assert any(
        len([p for p in c["pieces"] if p]) > 1 for c in calls
    )  # arguments arrive as incremental deltas
    assert reasons[-1] == "tool_calls" and not any(reasons[:-1])

    whole = _whole(fmt, text, FinishReason.STOP)
    assert whole["finish_reason"] == "tool_calls"
    assert whole["message"]["content"] == content
    got = whole["message"]["tool_calls"]
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in got] == EXPECTED_CALLS
    assert all(CALL_ID.fullmatch(c["id"]) and c["type"] == "function" for c in got)
    assert len({c["id"] for c in got}) == 2
    # The stream carries the same arguments text as the whole answer (the model's JSON, passed through).
    assert ["".join(c["pieces"]) for c in calls] == [c["function"]["arguments"] for c in got]


@pytest.mark.parametrize("family", sorted(OUTPUTS))
def test_parallel_tool_calls_false_keeps_only_the_first_call(family: str) -> None:
    fmt, text, _ = OUTPUTS[family]
    _, calls, reasons = _fold(_stream(fmt, _pieces(text, 7), FinishReason.STOP, parallel=False))
    assert [c["name"] for c in calls] == ["get_weather"] and reasons[-1] == "tool_calls"
    whole = _whole(fmt, text, FinishReason.STOP, parallel=False)
    assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == ["get_weather"]


def test_text_without_calls_is_content_and_a_cut_off_call_keeps_length() -> None:
    plain = "It is sunny. {not a call} <tool_ maybe"
    content, calls, reasons = _fold(_stream(QWEN25, _pieces(plain, 1), FinishReason.STOP))
    assert (content, calls, reasons[-1]) == (plain, [], "stop")
    whole = _whole(QWEN25, plain, FinishReason.STOP)
    assert (whole["message"], whole["finish_reason"]) == (
        {"role": "assistant", "content": plain, "refusal": None},
        "stop",
    )
    # No format (no tools, or tool_choice "none"): markup is only text.
    raw = OUTPUTS["qwen25"][1]
    assert _whole(None, raw, FinishReason.STOP)["message"]["content"] == raw
    # max_tokens cut the second call short: the first stands, and the reason stays "length".
    cut = raw[: raw.index('"days"')]
    whole = _whole(QWEN25, cut, FinishReason.LENGTH)
    assert (
        whole["finish_reason"] == "length"
        and whole["message"]["tool_calls"][0]["function"]["name"] == "get_weather"
    )
    assert _fold(_stream(QWEN25, _pieces(cut, 2), FinishReason.LENGTH))[2][-1] == "length"


# --- the real stack: the demo model (random Qwen3 weights, the real Qwen3 tokenizer and template) -----------------

MODEL = "demo"


@pytest.fixture(scope="module")
def served(stack_factory: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = stack_factory(tmp_path_factory.mktemp("tools"))
    try:
        yield stack
    finally:
        stack.stop(timeout_s=10)


@pytest.fixture(scope="module")
def client(served: Stack) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{served.gateway_urls[0]}/v1", api_key="unused", max_retries=0, timeout=120
    )


def test_tools_and_tool_history_are_served_and_rendered(client: openai.OpenAI) -> None:
    def ask(**fields: Any) -> Any:
        return client.chat.completions.create(
            model=MODEL, messages=HISTORY, max_tokens=4, temperature=0, **fields
        )

    plain, auto, none = ask(), ask(tools=TOOLS), ask(tools=TOOLS, tool_choice="none")
    # The tools reach the prompt (Qwen3's template writes them into the system turn); "none" leaves them out.
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens == none.usage.prompt_tokens
    assert auto.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_bad_tool_requests_are_400s_through_the_gateway(served: Stack) -> None:
    body = {"model": MODEL, "messages": HISTORY, "max_tokens": 2}
    cases = [
        ({"tools": _bad_tool(name="a b")}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"messages": [HISTORY[1], {"role": "tool", "content": "x", "tool_call_id": "call_x"}]},
            "messages[1].tool_call_id",
        ),
    ]
    with httpx.Client(base_url=served.gateway_urls[0], timeout=60) as http:
        for fields, param in cases:
            resp = http.post("/v1/chat/completions", json={**body, **fields})
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"]["param"] == param


NAMED = {"type": "function", "function": {"name": "get_forecast"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED], ids=["required", "named"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_tool_choice_required_and_named_are_enforced_by_the_grammar(
    client: openai.OpenAI, tool_choice: Any, stream: bool
) -> None:
    # Only get_forecast's schema bounds its arguments; "required" may pick either tool, so it gets that one only.
    tools = TOOLS[1:] if tool_choice == "required" else TOOLS
    for seed in range(3):
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "messages": HISTORY,
            "tools": tools,
            "tool_choice": tool_choice,
            "parallel_tool_calls": False,
            "max_tokens": 96,
            "seed": seed,
        }
        if stream:
            name, args, content, reason = "", "", "", None
            for chunk in client.chat.completions.create(stream=True, **kwargs):
                for choice in chunk.choices:
                    reason = choice.finish_reason or reason
                    content += choice.delta.content or ""
                    for tc in choice.delta.tool_calls or ():
                        assert tc.index == 0
                        name += (tc.function.name or "") if tc.function else ""
                        args += (tc.function.arguments or "") if tc.function else ""
            assert content == "", content  # the call's markup never leaks as content
        else:
            resp = client.chat.completions.create(**kwargs)
            (call,) = resp.choices[0].message.tool_calls
            name, args, reason = call.function.name, call.function.arguments, resp.choices[0].finish_reason
            assert resp.choices[0].message.content is None
        assert (name, reason) == ("get_forecast", "tool_calls"), (name, args, reason)
        jsonschema.validate(json.loads(args), FORECAST_SCHEMA)
