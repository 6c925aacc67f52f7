"""Qwen2.5, Qwen3 and Hermes ("qwen25", SGLang's parser name): `<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>`, one call per block, several blocks in a row."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubesgl.tool_formats.format import FunctionTool, ToolCallFormat
from kubesgl.tool_formats.grammar import calls_grammar


def detect(chat_template: str, special_tokens: frozenset[str]) -> bool:
    return "<tool_call>" in chat_template


def grammar(tools: Sequence[FunctionTool], at_most_one: bool) -> dict[str, Any]:
    return calls_grammar(
        tools, '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", at_most_one
    )


FORMAT = ToolCallFormat("qwen25", "<tool_call>", "</tool_call>", ("arguments",), detect, grammar)
