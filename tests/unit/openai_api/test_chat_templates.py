"""Chat templates with tools: the real Qwen3 template and Llama-3.1-style / Mistral-style templates (in
tests/data/chat_templates, put into a checkpoint's tokenizer_config) render the tool definitions, assistant
tool calls and tool results of OpenAI messages normalized by chat_history.template_messages."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from kubesgl.errors import InvalidRequestError
from kubesgl.models.random_init import TOKENIZER_FILES, build_random_model
from kubesgl.openai_api.chat_history import template_messages, template_tools
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.tool_formats import LLAMA3, MISTRAL, QWEN25, detect_tool_format, parse_tool_calls
from support.model_helpers import with_chat_template

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
                "required": ["city"],
            },
        },
    }
]
MESSAGES = [
    {"role": "developer", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris?", "name": "ann"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_0123456789abcdef01234567",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_0123456789abcdef01234567", "content": '{"temp_c": 21}'},
    {"role": "user", "content": [{"type": "text", "text": "And in"}, {"type": "text", "text": "Rome?"}]},
]
# How each family's template writes the assistant's call above.
RENDERED_CALL = {
    "qwen": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
    "llama3_json_tools.jinja": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
    "mistral_tools.jinja": '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}, '
    '"id": "call_0123456789abcdef01234567"}]',
}
FORMAT = {"qwen": QWEN25, "llama3_json_tools.jinja": LLAMA3, "mistral_tools.jinja": MISTRAL}


def _tokenizer_dir(src: str, out: Path, template: str) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(src) / name, out / name)
    return out if template == "qwen" else with_chat_template(out, template)


def _render(model_dir: Path, tools: list | None = TOOLS) -> str:
    tok = ModelTokenizer.load(str(model_dir))
    ids = tok.render_chat(template_messages(MESSAGES), True, {"tools": template_tools(tools)})
    return tok.hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("template", sorted(RENDERED_CALL))
def test_each_familys_template_renders_tools_calls_and_results(
    template, qwen_tokenizer_dir, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    model_dir = _tokenizer_dir(qwen_tokenizer_dir, tmp_path / "tok", template)
    text = _render(model_dir)
    assert "Current weather in a city" in text and '"get_weather"' in text and '"city"' in text
    assert RENDERED_CALL[template] in text
    assert "temp_c" in text and "You are terse." in text and "And in\nRome?" in text
    assert text.index("Weather in Paris?") < text.index("get_weather", text.index("Weather in Paris?"))
    # The template is what tells the parser which format the model writes ...
    fmt = detect_tool_format(ModelTokenizer.load(str(model_dir)).hf.chat_template)
    assert fmt is FORMAT[template]
    # ... and the call as the template wrote it parses back into the same call.
    parsed = parse_tool_calls(RENDERED_CALL[template], fmt)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"})
    ]
    assert "get_weather" not in _render(model_dir, tools=None).split("Weather in Paris?")[0]


def test_a_small_hf_model_renders_the_template_in_its_tokenizer_config(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model_dir = build_random_model("llama", tmp_path / "llama", tokenizer="qwen3")
    with_chat_template(model_dir, "llama3_json_tools.jinja")
    assert RENDERED_CALL["llama3_json_tools.jinja"] in _render(model_dir)


def test_messages_are_normalized_for_templates() -> None:
    out = template_messages(MESSAGES)
    assert out[0] == {"role": "system", "content": "You are terse."}
    assert out[1]["name"] == "ann"
    assert out[2]["content"] == "" and out[2]["tool_calls"] == [
        {
            "type": "function",
            "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},
            "id": "call_0123456789abcdef01234567",
        }
    ]
    assert out[3] == {
        "role": "tool",
        "content": '{"temp_c": 21}',
        "tool_call_id": "call_0123456789abcdef01234567",
        "name": "get_weather",
    }
    assert out[4]["content"] == "And in\nRome?"
    assert template_tools([]) is None and template_tools(None) is None


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        ([{"role": "function", "content": "x"}], "messages[0].role"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
        (
            [MESSAGES[1], {"role": "tool", "tool_call_id": "call_nope", "content": "1"}],
            "messages[1].tool_call_id",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{bad"}}
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}
                    ],
                }
            ],
            "messages[0].tool_calls[0].function.arguments",
        ),
        (
            [{"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function"}]}],
            "messages[0].tool_calls[0]",
        ),
    ],
)
def test_what_a_template_cannot_take_is_a_400_naming_the_field(messages, param) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(InvalidRequestError) as err:
        template_messages(messages)
    assert err.value.param == param
    with pytest.raises(InvalidRequestError) as err:
        template_tools([{"type": "file_search"}])
    assert err.value.param == "tools[0]"
