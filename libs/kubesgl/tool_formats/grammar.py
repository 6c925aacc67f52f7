"""The grammar every family's calls share: a structural tag per tool, `begin` + the tool's name + `middle`, its
arguments constrained by the tool's `parameters` schema, then `end`; several tags with a separator between
calls. Each family module supplies its own markup."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kubesgl.structured.constraint import DEFAULT_MAX_WHITESPACE
from kubesgl.tool_formats.format import FunctionTool


def calls_grammar(
    tools: Sequence[FunctionTool], begin: str, middle: str, end: str, separator: str, at_most_one: bool
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
