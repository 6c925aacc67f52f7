"""OpenAI error bodies, built from kubesgl errors and from request-validation failures. Errors other
services report arrive as protocol.ErrorInfo (ErrorInfo.to_error)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from kubesgl.errors import InvalidRequestError, KubesglError, join_paths, param_path
from kubesgl.openai_api.request_models import WIRE_JSON_ERROR

_TYPE_TAG = re.compile(r"[\[\-]")
_TYPE_NAMES = frozenset({"str", "int", "float", "bool"})


def error_body(err: KubesglError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_from_validation(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """One 400 from pydantic/FastAPI validation errors, naming the first offending field.

    Of a union's branch errors, a broken constraint (out of range, too long) says more than "not a string"."""
    first = next((e for e in errors if not str(e.get("type", "")).endswith("_type")), None) or (
        errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "request body is required"}
    )
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return InvalidRequestError(f"malformed JSON body: {detail}")
    loc = (
        list(first.get("loc", ()))[1:] if first.get("loc", ("",))[0] == "body" else list(first.get("loc", ()))
    )
    # Union branches show up in `loc` as type tags ("list[int]", "constrained-str"); no field of the request.
    parts = [p for p in loc if isinstance(p, int) or not (_TYPE_TAG.search(p) or p in _TYPE_NAMES)]
    param = param_path("", *parts) if parts else None
    if first.get("type") == "extra_forbidden":
        return InvalidRequestError(f"unsupported field: {param}", param=param)
    if first.get("type") == "missing" and not param:
        return InvalidRequestError("request body is required (JSON object)")
    if first.get("type") == WIRE_JSON_ERROR:
        ctx = first.get("ctx") or {}
        param = join_paths(param or "", str(ctx.get("path", ""))) or None
        return InvalidRequestError(f"{param} {ctx.get('why')}" if param else str(ctx.get("why")), param=param)
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")  # our validators' own words
    where = f"{param}: " if param and not msg.startswith(param) else ""
    return InvalidRequestError(f"{where}{msg}", param=param)
