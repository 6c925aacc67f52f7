"""What every tool-call family shares: the shape of a format (its markup, how a chat template shows it, the
grammar of its calls) and the parsed values (a call, an output of content and calls)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class FunctionTool:
    """One OpenAI function tool, checked (constraint.function_tools): its name and its parameters schema."""

    name: str
    parameters: dict[str, Any]


@dataclass(frozen=True)
class ToolCallFormat:
    """How one model family writes calls. `start` opens a block; `end` closes it ("" = the block ends where
    its calls stop); `separator` divides calls inside one block; `bare_open` is the character that may open
    a block without its marker at the very start of the output.

    `detect(chat_template, special_tokens)` says whether a model's chat template (or its tokenizer's special
    tokens) teaches this family; `grammar(tools, at_most_one)` is the xgrammar structural-tag format of calls
    to `tools` in this family's markup (one call at most, or one or more)."""

    name: str
    start: str
    end: str
    args_keys: tuple[str, ...]
    detect: Callable[[str, frozenset[str]], bool] = field(compare=False, repr=False)
    grammar: Callable[[Sequence[FunctionTool], bool], dict[str, Any]] = field(compare=False, repr=False)
    list_open: str = ""
    list_close: str = ""
    separator: str = ""
    bare_open: str = ""


def new_call_id() -> str:
    """OpenAI's shape: `call_` and 24 hex digits."""
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    id: str
    name: str
    arguments: str  # the arguments JSON as text

    def to_openai(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # None when the output was only calls (OpenAI sends null then)
    tool_calls: tuple[ToolCall, ...] = ()

    def finish_reason(self, engine_reason: str) -> str:
        return tool_finish_reason(bool(self.tool_calls), engine_reason)


def tool_finish_reason(made_calls: bool, engine_reason: str) -> str:
    """ "tool_calls" when calls were made and the output ended by itself; "length" stays "length"."""
    return "tool_calls" if made_calls and engine_reason == "stop" else engine_reason
