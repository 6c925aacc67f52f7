"""OpenAI error bodies: building them from kubesgl errors, from request-validation failures and from the
ErrorReply dicts other services send; plus the errors only the HTTP edge raises (401, 413, 429)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kubesgl.errors import (
    ContextLengthError,
    DeadlineExceededError,
    InvalidRequestError,
    KubesglError,
    ModelNotFoundError,
    ServiceUnavailableError,
)


class AuthenticationError(KubesglError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class PayloadTooLargeError(KubesglError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class RateLimitError(KubesglError):
    status = 429
    type = "rate_limit_error"
    code = "concurrency_limit_exceeded"


_BY_STATUS: dict[int, type[KubesglError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    404: ModelNotFoundError,
    413: PayloadTooLargeError,
    429: RateLimitError,
    503: ServiceUnavailableError,
    504: DeadlineExceededError,
}


def error_body(err: KubesglError) -> dict[str, Any]:
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


def error_from_wire(body: Mapping[str, Any]) -> KubesglError:
    """Rebuilds the typed error another service reported ({status, type, code, param, message})."""
    status = int(body.get("status") or 500)
    cls = (
        ContextLengthError
        if body.get("code") == ContextLengthError.code
        else _BY_STATUS.get(status, KubesglError)
    )
    err = cls(str(body.get("message") or "internal error"), param=body.get("param"))
    # Instance attributes keep the sender's exact status/type/code even where no subclass matches.
    err.status, err.type, err.code = status, str(body.get("type") or cls.type), body.get("code", cls.code)
    return err


def error_from_validation(errors: Sequence[Mapping[str, Any]]) -> InvalidRequestError:
    """One 400 from pydantic/FastAPI validation errors, naming the first offending field."""
    first = errors[0] if errors else {"type": "missing", "loc": ("body",), "msg": "request body is required"}
    if first.get("type") == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", first.get("msg"))
        return InvalidRequestError(f"malformed JSON body: {detail}")
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    # Union branches show up in `loc` as type names (e.g. "list[int]"); they are no field of the request.
    param = ".".join(p for p in loc if "[" not in p and p not in ("str", "int", "float", "bool")) or None
    if first.get("type") == "extra_forbidden":
        return InvalidRequestError(f"unsupported field: {param}", param=param)
    if first.get("type") == "missing" and not param:
        return InvalidRequestError("request body is required (JSON object)")
    where = f"{param}: " if param else ""
    return InvalidRequestError(f"{where}{first.get('msg', 'invalid value')}", param=param)
