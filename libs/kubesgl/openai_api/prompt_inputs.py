"""Normalizes the prompt shapes the API accepts into what the tokenizer service takes: chat messages as
protocol ChatMessages, or one PromptInput per completion prompt (text or token ids)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kubesgl.errors import InvalidRequestError, param_path
from kubesgl.openai_api import request_models
from kubesgl.openai_api.chat_history import template_messages
from kubesgl.protocol import ChatMessage, ChatToolCall, json_value_error

MAX_BATCH_PROMPTS = 64


@dataclass(frozen=True)
class PromptInput:
    """One prompt: exactly one of `text` / `input_ids` is set."""

    text: str | None = None
    input_ids: tuple[int, ...] | None = None


def chat_messages(messages: list[request_models.ChatMessage]) -> tuple[ChatMessage, ...]:
    """The messages as the template takes them (`chat_history.template_messages`: text parts joined, developer
    as system, tool-call arguments parsed, a tool result named after its call); a 400 names what it cannot."""
    out = []
    for i, m in enumerate(template_messages([msg.model_dump(exclude_none=True) for msg in messages])):
        calls = []
        for j, tc in enumerate(m.get("tool_calls", ())):
            where = f"messages[{i}].tool_calls[{j}].function.arguments"
            if error := json_value_error(tc["function"]["arguments"], where):  # it travels as msgpack
                raise InvalidRequestError(str(error), param=error.path)
            calls.append(ChatToolCall(tc["function"]["name"], tc["function"]["arguments"], tc.get("id")))
        out.append(ChatMessage(m["role"], m["content"], m.get("name"), tuple(calls), m.get("tool_call_id")))
    return tuple(out)


# OpenAI's default prompt (the document separator its models were trained with): a model then writes as if
# from the start of a new document. Tokenizers that know it as a special token (Qwen's) encode it as one.
DEFAULT_PROMPT = "<|endoftext|>"


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]] | None) -> list[PromptInput]:
    if prompt is None:
        prompt = DEFAULT_PROMPT
    # Validated (request_models): a list is all ints, all strings or all lists, so its first item says which.
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return [_prompt(prompt, "prompt")]
    _not_empty(prompt, "prompt")
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_BATCH_PROMPTS} prompts per request", param="prompt")
    return [_prompt(p, param_path("prompt", i)) for i, p in enumerate(prompt)]  # type: ignore[arg-type]


def native_prompt(text: str | None, input_ids: list[int] | None) -> PromptInput:
    return _prompt(text, "text") if text is not None else _prompt(input_ids or [], "input_ids")


def _prompt(prompt: str | list[int], where: str) -> PromptInput:
    """One prompt, text or token ids; empty either way is the same 400 (the engine needs a token to start from)."""
    _not_empty(prompt, where)
    if isinstance(prompt, str):
        return PromptInput(text=prompt)
    if min(prompt) < 0 or max(prompt) >= 2**63:
        raise InvalidRequestError(f"{where}: token ids must be >= 0 and 64-bit", param=where)
    return PromptInput(input_ids=tuple(prompt))


def _not_empty(prompt: str | list[Any], where: str) -> None:
    if not prompt:
        raise InvalidRequestError(f"{where} must not be empty", param=where)
