"""Turns a TokenizeRequest into prompt token ids, and checks them against the model's context length."""

from __future__ import annotations

from typing import Any

from kubesgl.errors import ContextLengthError, InvalidRequestError
from kubesgl.protocol import TokenizeRequest
from kubesgl.text.tokenizer import ModelTokenizer


def prompt_ids(req: TokenizeRequest, tokenizer: ModelTokenizer) -> list[int]:
    """The prompt's token ids: the chat template applied to messages, an encoded text, or ids as given."""
    if req.kind == "chat":
        ids = tokenizer.render_chat(
            _messages(req.messages), req.add_generation_prompt, req.chat_template_kwargs
        )
    elif req.kind == "completion":
        if not isinstance(req.prompt, str):
            raise InvalidRequestError("prompt must be a string", param="prompt")
        ids = tokenizer.encode(req.prompt)
    elif req.kind == "tokens":
        ids = _token_ids(req.input_ids, tokenizer.vocab_size)
    else:
        raise InvalidRequestError(f"unknown prompt kind {req.kind!r}; one of {TokenizeRequest.KINDS}")
    if not ids:
        raise InvalidRequestError("the prompt is empty", param=_prompt_param(req))
    return ids


def check_context(req: TokenizeRequest, prompt_tokens: int, max_tokens: int, context_len: int) -> None:
    """Refuses a request that cannot fit: prompt plus completion must stay within the context (OpenAI's text)."""
    total = prompt_tokens + max_tokens
    if total <= context_len:
        return
    where = "in the messages" if req.kind == "chat" else "in the prompt"
    raise ContextLengthError(
        f"This model's maximum context length is {context_len} tokens. However, you requested {total} tokens "
        f"({prompt_tokens} {where}, {max_tokens} in the completion). "
        "Please reduce the length of the messages or completion.",
        param=_prompt_param(req),
    )


def _prompt_param(req: TokenizeRequest) -> str:
    return "messages" if req.kind == "chat" else "prompt"


def _messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list", param="messages")
    for i, m in enumerate(messages):
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise InvalidRequestError(
                f"messages[{i}] must have a string role and string content", param=f"messages[{i}]"
            )
    return messages


def _token_ids(ids: Any, vocab_size: int) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise InvalidRequestError("input_ids must be a list of integers", param="prompt")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    return list(ids)
