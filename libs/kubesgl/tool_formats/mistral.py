"""Mistral ("mistral"): `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`; the list may also start the
output (`[TOOL_CALLS]` is a special token that a decode with skip_special_tokens drops)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubesgl.tool_formats.format import FunctionTool, ToolCallFormat
from kubesgl.tool_formats.grammar import calls_grammar


def detect(chat_template: str, special_tokens: frozenset[str]) -> bool:
    return "[TOOL_CALLS]" in chat_template or "[TOOL_CALLS]" in special_tokens


def grammar(tools: Sequence[FunctionTool], at_most_one: bool) -> dict[str, Any]:
    calls = calls_grammar(tools, '{"name": "', '", "arguments": ', "}", ", ", at_most_one)
    return {
        "type": "sequence",
        "elements": [
            {"type": "const_string", "value": "[TOOL_CALLS]["},
            calls,
            {"type": "const_string", "value": "]"},
        ],
    }


FORMAT = ToolCallFormat(
    "mistral",
    "[TOOL_CALLS]",
    "",
    ("arguments",),
    detect,
    grammar,
    list_open="[",
    list_close="]",
    separator=",",
    bare_open="[",
)
