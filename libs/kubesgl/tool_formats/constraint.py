"""Enforces `tool_choice` with a grammar: "required" (at least one call, to any of the tools) and a named
function (exactly one call, to that function) become an xgrammar structural tag in the model family's own
call format, each call's arguments constrained by that tool's `parameters` schema. "auto" and "none" need no
grammar ("none" only leaves the tools out of the prompt), so they give None.

The grammar covers the calls only: with "required" the output is the calls and nothing else (OpenAI's
required mode returns no content either), which `stream.parse_tool_calls` turns back into tool_calls.
"""

from __future__ import annotations

import json
import re
from typing import Any

from kubesgl.errors import InvalidRequestError
from kubesgl.structured.constraint import Constraint
from kubesgl.tool_formats.format import FunctionTool, ToolCallFormat

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names
_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


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
    tag = {"type": "structural_tag", "format": fmt.grammar(chosen, at_most_one)}
    return Constraint("structural_tag", json.dumps(tag, separators=(",", ":")), param="tool_choice")
