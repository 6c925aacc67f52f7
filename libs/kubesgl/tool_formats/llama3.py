"""Llama 3.1/3.2 JSON tool calling ("llama3"): `{"name": ..., "parameters": {...}}` at the start of the output
or after `<|python_tag|>`, several separated by `;`. `<|python_tag|>` is a special token that a decode with
skip_special_tokens drops; the bare form (output starting with `{`) still parses."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubesgl.tool_formats.format import FunctionTool, ToolCallFormat
from kubesgl.tool_formats.grammar import calls_grammar


def detect(chat_template: str, special_tokens: frozenset[str]) -> bool:
    # Llama 3.2's template writes no python_tag; its `ipython` role and "parameters" key name the family.
    return "<|python_tag|>" in chat_template or (
        "ipython" in chat_template and '"parameters"' in chat_template
    )


def grammar(tools: Sequence[FunctionTool], at_most_one: bool) -> dict[str, Any]:
    return calls_grammar(tools, '{"name": "', '", "parameters": ', "}", "; ", at_most_one)


FORMAT = ToolCallFormat(
    "llama3",
    "<|python_tag|>",
    "",
    ("parameters", "arguments"),
    detect,
    grammar,
    separator=";",
    bare_open="{",
)
