"""How much of a client's free-form JSON the wire carries, and the check that names what exceeds it."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

from kubesgl.errors import param_path

# What msgpack carries of a client's free-form JSON (chat_template_kwargs, tool definitions, ...). Checked where
# the value enters (the gateway's request models), so encoding a message can never fail on user data.
WIRE_INT_MIN, WIRE_INT_MAX = -(2**63), 2**63 - 1
MAX_JSON_DEPTH = 32
MAX_JSON_STRING = 1 << 16


class JsonValueError(NamedTuple):
    """Why a JSON value cannot travel on the wire: `path` (errors.param_path's syntax) and what is wrong there."""

    path: str
    why: str

    def __str__(self) -> str:
        return f"{self.path} {self.why}" if self.path else self.why


def json_value_error(value: Any, where: str) -> JsonValueError | None:
    """Why `value` (parsed JSON) cannot travel on the wire, naming the offending path below `where`; None when
    it can."""
    return _json_error(value, where, where, 0)


def _json_error(value: Any, root: str, where: str, depth: int) -> JsonValueError | None:
    if depth > MAX_JSON_DEPTH:
        return JsonValueError(root, f"is nested deeper than {MAX_JSON_DEPTH} levels")
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, int):
        ok = WIRE_INT_MIN <= value <= WIRE_INT_MAX
        return None if ok else JsonValueError(where, "is outside the 64-bit integer range")
    if isinstance(value, float):
        return None if math.isfinite(value) else JsonValueError(where, "is not a finite number")
    if isinstance(value, str):
        ok = len(value) <= MAX_JSON_STRING
        return None if ok else JsonValueError(where, f"is longer than {MAX_JSON_STRING} characters")
    if isinstance(value, list):
        items = ((param_path(where, i), v) for i, v in enumerate(value))
    elif isinstance(value, dict):
        for k in value:
            if not isinstance(k, str):
                return JsonValueError(where, f"has a non-string key {k!r}")
            if len(k) > MAX_JSON_STRING:
                return JsonValueError(where, f"has a key longer than {MAX_JSON_STRING} characters")
        items = ((param_path(where, k), v) for k, v in value.items())
    else:
        return JsonValueError(where, f"holds a {type(value).__name__}, which is not a JSON value")
    return next((e for path, v in items if (e := _json_error(v, root, path, depth + 1))), None)
