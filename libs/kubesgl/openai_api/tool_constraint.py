"""Enforces `tool_choice` with a grammar: "required" (at least one call, to any of the tools) and a named
function (exactly one call, to that function) become an xgrammar structural tag in the model family's own
call format, each call's arguments constrained by that tool's `parameters` schema. "auto" and "none" need no
grammar ("none" only leaves the tools out of the prompt), so they give None.

The grammar covers the calls only: with "required" the output is the calls and nothing else (OpenAI's
required mode returns no content either), which `tool_calls.parse_tool_calls` turns back into tool_calls.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from kubesgl.errors import InvalidRequestError
from kubesgl.openai_api.tool_calls import LLAMA3, MISTRAL, QWEN25, ToolCallFormat
from kubesgl.structured.constraint import DEFAULT_MAX_WHITESPACE, Constraint

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class FunctionTool:
    name: str
    parameters: dict[str, Any]


def function_tools(tools: list[dict[str, Any]]) -> list[FunctionTool]:
    """The OpenAI `tools` list, checked: function tools with a valid name and an object schema (an omitted
    `parameters` means no arguments, as OpenAI defines it)."""
    out: list[FunctionTool] = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise InvalidRequestError(
                f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where
            )
        fn = tool["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidRequestError(
                f"{where}.function.name must be 1-64 letters, digits, '_' or '-'",
                param=f"{where}.function.name",
            )
        params = fn.get("parameters")
        if params is None:
            params = _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise InvalidRequestError(
                f"{where}.function.parameters must be a JSON schema object",
                param=f"{where}.function.parameters",
            )
        if any(t.name == name for t in out):
            raise InvalidRequestError(
                f"{where}: two tools are named {name!r}", param=f"{where}.function.name"
            )
        out.append(FunctionTool(name, params))
    return out


def tool_choice_constraint(
    fmt: ToolCallFormat,
    tools: list[dict[str, Any]],
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool = True,
) -> Constraint | None:
    """The constraint enforcing `tool_choice` in `fmt`, or None when nothing is enforced ("auto", "none")."""
    if tool_choice in (None, "auto", "none"):
        return None
    declared = function_tools(tools)
    if tool_choice == "required":
        if not declared:
            raise InvalidRequestError("tool_choice 'required' needs at least one tool", param="tool_choice")
        chosen, at_most_one = declared, not parallel_tool_calls
    elif isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        name = (tool_choice.get("function") or {}).get("name")
        chosen = [t for t in declared if t.name == name]
        if not chosen:
            raise InvalidRequestError(
                f"tool_choice names {name!r}, which is not in tools", param="tool_choice"
            )
        at_most_one = True
    else:
        raise InvalidRequestError(
            "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
            param="tool_choice",
        )
    tag = {"type": "structural_tag", "format": _calls_format(fmt, chosen, at_most_one)}
    return Constraint("structural_tag", json.dumps(tag, separators=(",", ":")), param="tool_choice")


def _calls_format(fmt: ToolCallFormat, tools: list[FunctionTool], at_most_one: bool) -> dict[str, Any]:
    if fmt is QWEN25:
        return _calls(
            tools, '<tool_call>\n{"name": "', '", "arguments": ', "}\n</tool_call>", "\n", at_most_one
        )
    if fmt is LLAMA3:
        return _calls(tools, '{"name": "', '", "parameters": ', "}", "; ", at_most_one)
    if fmt is MISTRAL:
        calls = _calls(tools, '{"name": "', '", "arguments": ', "}", ", ", at_most_one)
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "[TOOL_CALLS]["},
                calls,
                {"type": "const_string", "value": "]"},
            ],
        }
    raise ValueError(f"no grammar for tool-call format {fmt.name!r}")


def _calls(
    tools: list[FunctionTool], begin: str, middle: str, end: str, separator: str, at_most_one: bool
) -> dict[str, Any]:
    tags = [
        {
            "type": "tag",
            "begin": f"{begin}{t.name}{middle}",
            "content": {
                "type": "json_schema",
                "json_schema": t.parameters,
                "max_whitespace_cnt": DEFAULT_MAX_WHITESPACE,
            },
            "end": end,
        }
        for t in tools
    ]
    if at_most_one and len(tags) == 1:
        return tags[0]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": separator,
        "at_least_one": True,
        "stop_after_first": at_most_one,
    }
