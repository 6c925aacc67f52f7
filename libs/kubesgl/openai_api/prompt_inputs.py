"""Normalizes the prompt shapes the API accepts into what the tokenizer service takes: chat messages as
protocol ChatMessages, or one PromptInput per completion prompt (text or token ids)."""

from __future__ import annotations

from dataclasses import dataclass

from kubesgl.errors import InvalidRequestError
from kubesgl.openai_api import request_models
from kubesgl.protocol import ChatMessage

MAX_BATCH_PROMPTS = 64


@dataclass(frozen=True)
class PromptInput:
    """One prompt: exactly one of `text` / `input_ids` is set."""

    text: str | None = None
    input_ids: tuple[int, ...] | None = None


def chat_messages(messages: list[request_models.ChatMessage]) -> tuple[ChatMessage, ...]:
    """Text parts are joined with newlines (vLLM's rule); "developer" is OpenAI's newer name for "system"."""
    return tuple(
        ChatMessage(
            role="system" if msg.role == "developer" else msg.role,
            content=msg.content if isinstance(msg.content, str) else "\n".join(p.text for p in msg.content),
        )
        for msg in messages
    )


# OpenAI's default prompt (the document separator its models were trained with): a model then writes as if
# from the start of a new document. Tokenizers that know it as a special token (Qwen's) encode it as one.
DEFAULT_PROMPT = "<|endoftext|>"


def completion_prompts(prompt: str | list[str] | list[int] | list[list[int]] | None) -> list[PromptInput]:
    if prompt is None:
        prompt = DEFAULT_PROMPT
    if isinstance(prompt, str):
        return [PromptInput(text=prompt)]
    if not prompt:
        raise InvalidRequestError("prompt must not be empty", param="prompt")
    if all(isinstance(p, int) for p in prompt):
        return [PromptInput(input_ids=_token_ids(prompt))]
    if len(prompt) > MAX_BATCH_PROMPTS:
        raise InvalidRequestError(f"at most {MAX_BATCH_PROMPTS} prompts per request", param="prompt")
    if all(isinstance(p, str) for p in prompt):
        return [PromptInput(text=p) for p in prompt]
    return [PromptInput(input_ids=_token_ids(p)) for p in prompt]


def native_prompt(text: str | None, input_ids: list[int] | None) -> PromptInput:
    return PromptInput(text=text) if text is not None else PromptInput(input_ids=_token_ids(input_ids or []))


def _token_ids(ids: list[int]) -> tuple[int, ...]:
    if not ids:
        raise InvalidRequestError("a token-id prompt must not be empty", param="prompt")
    if any(not 0 <= i < 2**63 for i in ids):
        raise InvalidRequestError("token ids must be >= 0 and 64-bit", param="prompt")
    return tuple(ids)
