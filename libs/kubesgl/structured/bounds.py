"""Bounds for a JSON schema's open values, for models that never close one by themselves (the demo model).

A random-weight model follows a grammar token by token but has no reason to end an open string, a number's
digits, an array or a free-form object: every constrained answer then ends at `length`, and a client (the
OpenAI SDK's `parse()`) sees the feature as broken. `bound_open_values` adds the bounds JSON Schema already
has — maxLength, minimum/maximum, maxItems, maxProperties and propertyNames — wherever a schema leaves them
open, so the grammar itself closes each value after a few tokens. The scheduler applies it only with
`--bound-json-values` (set by `kubesgl up` for the demo model): a real model's grammar stays the client's
schema exactly.
"""

from __future__ import annotations

import json
from typing import Any

MAX_CHARS = 16  # an open string: at most this many characters
MAX_ABS = 10**6  # an open number: within +-this
MAX_ITEMS = 4  # an open array or free-form object: at most this many entries
# What a free-form object's values may be: scalars, each bounded as above.
_FREE_VALUE = {
    "type": ["string", "integer", "boolean", "null"],
    "maxLength": MAX_CHARS,
    "minimum": -MAX_ABS,
    "maximum": MAX_ABS,
}
_CLOSED_BY = ("enum", "const")  # a value with one of these has a finite set of spellings already


def bound_open_values(schema: Any) -> Any:
    """`schema` (parsed JSON) with every open string, number, array and free-form object bounded."""
    if isinstance(schema, list):
        return [bound_open_values(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: bound_open_values(v) for k, v in schema.items()}
    kind = out.get("type")
    kinds = kind if isinstance(kind, list) else [kind]
    if any(k in out for k in _CLOSED_BY):
        return out
    if "string" in kinds and not any(k in out for k in ("maxLength", "pattern", "format")):
        out["maxLength"] = MAX_CHARS
    if "integer" in kinds or "number" in kinds:
        if "maximum" not in out and "exclusiveMaximum" not in out:
            out["maximum"] = MAX_ABS
        if "minimum" not in out and "exclusiveMinimum" not in out:
            out["minimum"] = -MAX_ABS
    if "array" in kinds and "maxItems" not in out:
        out["maxItems"] = MAX_ITEMS
    if "object" in kinds and "properties" not in out and "maxProperties" not in out:
        out["maxProperties"] = MAX_ITEMS
        out.setdefault("propertyNames", {"maxLength": MAX_CHARS})
        out.setdefault("additionalProperties", dict(_FREE_VALUE))
    return out


def bound_source(source: str) -> str:
    """The same for a schema (or a structural tag holding schemas) given as JSON text."""
    return json.dumps(bound_open_values(json.loads(source)))
