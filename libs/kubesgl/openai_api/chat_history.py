"""Normalizes OpenAI chat messages (and tools) into what HF chat templates take.

OpenAI's shapes and the templates' differ: arguments of an assistant's tool_calls are a JSON *string* in the
API, a dict in the templates (Qwen3's writes `arguments | tojson`, Llama's reads its keys); content may be
a list of parts or null; a `tool` message names its call only by `tool_call_id`, while some templates want
the function's `name`. The result is plain dicts: {role, content, [name], [tool_calls], [tool_call_id]}.
"""

from __future__ import annotations

import json
from typing import Any

from kubesgl.errors import InvalidRequestError

_ROLES = ("system", "developer", "user", "assistant", "tool")


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Raises InvalidRequestError naming `messages[i]...` for what a template cannot be given."""
    out: list[dict[str, Any]] = []
    call_names: dict[str, str] = {}  # tool_call_id -> function name, from the assistant turns so far
    for i, msg in enumerate(messages):
        where = f"messages[{i}]"
        role = msg.get("role")
        if role not in _ROLES:
            raise InvalidRequestError(
                f"{where}.role must be one of {', '.join(_ROLES)} (got {role!r})", param=f"{where}.role"
            )
        item: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": _text(msg.get("content"), f"{where}.content", allow_null=role == "assistant"),
        }
        if msg.get("name") is not None:
            item["name"] = msg["name"]
        if role == "assistant" and msg.get("tool_calls"):
            item["tool_calls"] = [
                _tool_call(tc, f"{where}.tool_calls[{j}]", call_names)
                for j, tc in enumerate(msg["tool_calls"])
            ]
        if role == "tool":
            call_id = msg.get("tool_call_id")
            if not isinstance(call_id, str) or call_id not in call_names:
                raise InvalidRequestError(
                    f"{where}.tool_call_id must name a tool call of an earlier assistant message",
                    param=f"{where}.tool_call_id",
                )
            item["tool_call_id"] = call_id
            item.setdefault("name", call_names[call_id])
        out.append(item)
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """OpenAI's tool entries are what the templates iterate (`{"type": "function", "function": {...}}`);
    only function tools can be rendered. None or [] renders no tools."""
    if not tools:
        return None
    for i, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            raise InvalidRequestError(f"tools[{i}] must be a function tool", param=f"tools[{i}]")
    return tools


def _text(content: Any, where: str, allow_null: bool) -> str:
    if content is None:
        if allow_null:  # an assistant turn that only called tools
            return ""
        raise InvalidRequestError(f"{where} is required", param=where)
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind in ("text", "refusal") and isinstance(part.get(kind), str):
                texts.append(part[kind])
            else:
                raise InvalidRequestError(
                    f"{where}[{j}]: only text content parts are supported (got {kind!r})",
                    param=f"{where}[{j}]",
                )
        return "\n".join(texts)  # vLLM's rule for several text parts
    raise InvalidRequestError(f"{where} must be a string or a list of content parts", param=where)


def _tool_call(tc: Any, where: str, call_names: dict[str, str]) -> dict[str, Any]:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if (
        not isinstance(fn, dict)
        or not isinstance(fn.get("name"), str)
        or tc.get("type", "function") != "function"
    ):
        raise InvalidRequestError(f"{where} must be a function call with a name", param=where)
    raw = fn.get("arguments", "{}")
    try:
        arguments = json.loads(raw) if isinstance(raw, str) else raw
    except json.JSONDecodeError as e:
        raise InvalidRequestError(
            f"{where}.function.arguments is not valid JSON: {e}", param=f"{where}.function.arguments"
        ) from None
    if not isinstance(arguments, dict):
        raise InvalidRequestError(
            f"{where}.function.arguments must be a JSON object", param=f"{where}.function.arguments"
        )
    call_id = tc.get("id")
    if isinstance(call_id, str):
        call_names[call_id] = fn["name"]
    out: dict[str, Any] = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if isinstance(call_id, str):
        out["id"] = call_id
    return out
