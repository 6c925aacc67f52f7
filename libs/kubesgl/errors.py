"""Typed errors shared by the engine and the services; each maps to one OpenAI error status."""

from __future__ import annotations

import json
import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def param_path(path: str, *parts: str | int) -> str:
    """`path` extended by `parts`, in the one syntax every 400's `param` uses (OpenAI's): `tools[0].function.name`;
    a key that is not a plain name stands in JSON quotes, `logit_bias["5"]`, `[""]`. `path` may be ""."""
    for part in parts:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _NAME.fullmatch(part):
            path += f".{part}" if path else part
        else:
            path += f"[{json.dumps(part)}]"
    return path


def join_paths(path: str, rest: str) -> str:
    """Two paths in that syntax, one after the other (`rest` as param_path builds it from "")."""
    return path + rest if not path or not rest or rest.startswith("[") else f"{path}.{rest}"


class KubesglError(Exception):
    """Base class. `status` is the HTTP status the gateway answers with; `code` the OpenAI error code."""

    status = 500
    type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequestError(KubesglError):
    status = 400
    type = "invalid_request_error"


class ContextLengthError(InvalidRequestError):
    code = "context_length_exceeded"


class ModelNotFoundError(KubesglError):
    status = 404
    type = "invalid_request_error"
    code = "model_not_found"


class UnsupportedModelError(KubesglError):
    """The checkpoint's architecture has no implementation here."""

    status = 400
    type = "invalid_request_error"
    code = "unsupported_model"


class ServiceUnavailableError(KubesglError):
    status = 503
    type = "service_unavailable"


class DeadlineExceededError(KubesglError):
    status = 504
    type = "timeout"


class AuthenticationError(KubesglError):
    """Raised at the HTTP edge only, like the two below."""

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
