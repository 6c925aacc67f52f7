"""Turns a TokenizeRequest into prompt token ids, and checks them against the model's context length."""

from __future__ import annotations

from kubesgl.errors import ContextLengthError, InvalidRequestError
from kubesgl.protocol import PromptKind, TokenizeRequest
from kubesgl.text.tokenizer import ModelTokenizer


def prompt_ids(req: TokenizeRequest, tokenizer: ModelTokenizer) -> list[int]:
    """The prompt's token ids: the chat template applied to messages, an encoded text, or ids as given."""
    if req.kind is PromptKind.CHAT:
        if not req.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        messages = [{"role": m.role, "content": m.content} for m in req.messages]
        ids = tokenizer.render_chat(messages, req.add_generation_prompt, req.chat_template_kwargs)
    elif req.kind is PromptKind.COMPLETION:
        if req.prompt is None:
            raise InvalidRequestError("prompt must be a string", param="prompt")
        ids = tokenizer.encode(req.prompt)
    else:
        ids = _token_ids(req.input_ids or [], tokenizer.vocab_size)
    if not ids:
        raise InvalidRequestError("the prompt is empty", param=_prompt_param(req))
    return ids


def check_context(req: TokenizeRequest, prompt_tokens: int, context_len: int) -> None:
    """Refuses a request that cannot fit: prompt plus completion must stay within the context (OpenAI's text).
    Without max_tokens the completion is the rest of the context, so the prompt must leave at least one token."""
    max_tokens = req.sampling.max_tokens
    completion = max_tokens if max_tokens is not None else max(context_len - prompt_tokens, 1)
    total = prompt_tokens + completion
    if total <= context_len:
        return
    where = "in the messages" if req.kind is PromptKind.CHAT else "in the prompt"
    raise ContextLengthError(
        f"This model's maximum context length is {context_len} tokens. However, you requested {total} tokens "
        f"({prompt_tokens} {where}, {completion} in the completion). "
        "Please reduce the length of the messages or completion.",
        param=_prompt_param(req),
    )


def _prompt_param(req: TokenizeRequest) -> str:
    return "messages" if req.kind is PromptKind.CHAT else "prompt"


def _token_ids(ids: list[int], vocab_size: int) -> list[int]:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    return ids
