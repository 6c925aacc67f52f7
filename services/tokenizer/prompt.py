"""Turns a TokenizeRequest into prompt token ids, and checks them against the model's context length."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from kubesgl.errors import ContextLengthError, InvalidRequestError
from kubesgl.protocol import ChatMessage, PromptKind, TokenizeRequest
from kubesgl.text.tokenizer import ModelTokenizer
from kubesgl.tool_formats import ToolCallFormat, detect_tool_format, tool_choice_constraint
from kubesgl.values.sampling import SamplingParams


def model_tool_format(tokenizer: ModelTokenizer) -> ToolCallFormat | None:
    """How this model writes tool calls, read off its chat template (the family's markup in it) and special
    tokens: the same knowledge picks the parser at the gateway and the grammar for `tool_choice` here."""
    return detect_tool_format(tokenizer.chat_template_text, tokenizer.special_tokens)


def tool_format_for(req: TokenizeRequest, model_format: ToolCallFormat | None) -> ToolCallFormat | None:
    """The format `req`'s output is parsed in: None without tools or with tool_choice "none" (the tools are
    then left out of the prompt, and the output is plain content); a 400 when the model's template has no
    tool-call format we know."""
    if not req.tools or req.tool_choice == "none":
        return None
    if model_format is None:
        raise InvalidRequestError(
            "this model's chat template writes no tool-call format kubesgl can parse "
            "(qwen25, llama3 or mistral); tools are not supported for it",
            param="tools",
        )
    return model_format


def tool_sampling(req: TokenizeRequest, fmt: ToolCallFormat | None) -> SamplingParams:
    """`req.sampling`, with tool_choice "required" or a named function enforced by a grammar of `fmt`'s calls
    (the gateway checked the tools and the choice; only here is the model's format known)."""
    if fmt is None:
        return req.sampling
    constraint = tool_choice_constraint(fmt, list(req.tools), req.tool_choice, req.parallel_tool_calls)
    if constraint is None:
        return req.sampling
    if req.sampling.constraint is not None:
        raise InvalidRequestError(
            "tool_choice 'required' or a named function cannot be combined with a structured response_format",
            param="tool_choice",
        )
    return replace(req.sampling, constraint=constraint)


def prompt_ids(req: TokenizeRequest, tokenizer: ModelTokenizer) -> list[int]:
    """The prompt's token ids: the chat template applied to messages, an encoded text, or ids as given."""
    if req.kind is PromptKind.CHAT:
        if not req.messages:
            raise InvalidRequestError("messages must be a non-empty list", param="messages")
        messages = [_template_message(m) for m in req.messages]
        kwargs = dict(req.chat_template_kwargs or {})
        if req.tools and req.tool_choice != "none":
            kwargs["tools"] = list(req.tools)
        ids = tokenizer.render_chat(messages, req.add_generation_prompt, kwargs)
    elif req.kind is PromptKind.COMPLETION:
        if req.prompt is None:
            raise InvalidRequestError("prompt must be a string", param="prompt")
        ids = tokenizer.encode(req.prompt)
    else:
        ids = _token_ids(req.input_ids or [], tokenizer.vocab_size)
    if not ids:
        param = _prompt_param(req)
        raise InvalidRequestError(f"{param} must not be empty", param=param)  # the gateway's words
    return ids


def _template_message(m: ChatMessage) -> dict[str, Any]:
    """The dict HF templates read: {role, content, [name], [tool_calls], [tool_call_id]}."""
    out: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.name is not None:
        out["name"] = m.name
    if m.tool_calls:
        out["tool_calls"] = [
            {
                **({"id": c.id} if c.id is not None else {}),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in m.tool_calls
        ]
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    return out


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
    if ids and (min(ids) < 0 or max(ids) >= vocab_size):  # C-speed; the loop below only names the culprit
        bad = next(t for t in ids if not 0 <= t < vocab_size)
        raise InvalidRequestError(
            f"token id {bad} is outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    return ids
