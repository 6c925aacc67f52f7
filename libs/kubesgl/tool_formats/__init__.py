"""Tool calls in each model family's own format: one module per family (`qwen25`, `llama3`, `mistral`), each
owning its markup (a `ToolCallFormat`), how a chat template shows it (`detect`) and the grammar that enforces
`tool_choice` in it (`grammar`). Shared by the tokenizer (detects the format, compiles the grammar) and the
gateway (parses the output into OpenAI `tool_calls`, whole or streamed):

- `format`: the format type and the parsed values (`ToolCall`, `ParsedOutput`);
- `stream`: one state machine, driven by a format's markup, that parses whole outputs and streams alike;
- `grammar`: the structural-tag shape the families' grammars share;
- `constraint`: OpenAI's `tools` checked, and `tool_choice` turned into a grammar constraint.
"""

from __future__ import annotations

from kubesgl.tool_formats import llama3, mistral, qwen25
from kubesgl.tool_formats.constraint import function_tools, tool_choice_constraint
from kubesgl.tool_formats.format import (
    FunctionTool,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    new_call_id,
    tool_finish_reason,
)
from kubesgl.tool_formats.stream import ToolCallStream, fold_deltas, parse_tool_calls

QWEN25 = qwen25.FORMAT
LLAMA3 = llama3.FORMAT
MISTRAL = mistral.FORMAT
# In the order detection asks them: a Mistral template may also mention other markup.
FORMATS = {f.name: f for f in (MISTRAL, QWEN25, LLAMA3)}


def detect_tool_format(
    chat_template: str | None, special_tokens: frozenset[str] = frozenset()
) -> ToolCallFormat | None:
    """The format a model's chat template teaches it: the markup the template writes for tool calls (or the
    tokenizer's special tokens) names the family. None: the template knows no tools."""
    template = chat_template or ""
    return next((f for f in FORMATS.values() if f.detect(template, special_tokens)), None)


__all__ = [
    "FORMATS",
    "LLAMA3",
    "MISTRAL",
    "QWEN25",
    "FunctionTool",
    "ParsedOutput",
    "ToolCall",
    "ToolCallFormat",
    "ToolCallStream",
    "detect_tool_format",
    "fold_deltas",
    "function_tools",
    "new_call_id",
    "parse_tool_calls",
    "tool_choice_constraint",
    "tool_finish_reason",
]
