"""The grammar constraint one request carries: what kind (JSON schema, any JSON object, regex, EBNF, or an
xgrammar structural tag for tool calls) and its source text. A plain value: it travels on the wire as a
`{kind, source}` map and is compiled where the vocabulary is (see `compiler.py`).

`check_constraint` parses the source with xgrammar without a vocabulary (milliseconds, no token masks), so the
service that first sees a request can refuse a schema xgrammar cannot handle with a 400 naming the field,
before the request is admitted anywhere."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kubesgl.errors import InvalidRequestError

ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = get_args(ConstraintKind)
MAX_SOURCE_CHARS = 256 * 1024  # a schema this long is a mistake or an attack; compile time grows with it

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed-check preamble.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_ERROR_CHARS = 300


@dataclass(frozen=True)
class Constraint:
    """`source`: the JSON schema text (json_schema), the regex, the EBNF grammar (root rule `root`), or the
    structural tag JSON; empty for json_object. `param` names the request field it came from, for errors; it
    is not part of the constraint's identity (two fields with the same schema share one compiled grammar)."""

    kind: ConstraintKind
    source: str = ""
    param: str = field(default="response_format", compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"unknown constraint kind {self.kind!r}; one of {KINDS}", param=self.param
            )
        if self.kind == "json_object" and self.source:
            raise InvalidRequestError("a json_object constraint has no source", param=self.param)
        if self.kind != "json_object" and not self.source:
            raise InvalidRequestError(f"the {self.kind} constraint is empty", param=self.param)
        if len(self.source) > MAX_SOURCE_CHARS:
            raise InvalidRequestError(
                f"the {self.kind} is longer than {MAX_SOURCE_CHARS} characters", param=self.param
            )

    @classmethod
    def json_schema(cls, schema: dict[str, Any] | bool | str, param: str = "response_format") -> Constraint:
        """From a schema object (or its JSON text). Compact, key order kept: xgrammar emits properties in
        the schema's declared order, so reordering keys would change the output."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}", param=param) from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object or a boolean", param=param)
        return cls("json_schema", json.dumps(schema, separators=(",", ":"), ensure_ascii=False), param)

    @property
    def key(self) -> tuple[str, str]:
        """What the compiled grammar depends on (the compiler's cache key)."""
        return (self.kind, self.source)

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind, "source": self.source, "param": self.param}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Constraint:
        return cls(d["kind"], d.get("source", ""), d.get("param", "response_format"))


def check_constraint(constraint: Constraint) -> None:
    """Raises InvalidRequestError naming `constraint.param` if xgrammar cannot build the grammar."""
    import xgrammar as xgr

    builders = {
        "json_schema": xgr.Grammar.from_json_schema,
        "json_object": lambda _: xgr.Grammar.builtin_json_grammar(),
        "regex": xgr.Grammar.from_regex,
        "ebnf": xgr.Grammar.from_ebnf,
        "structural_tag": xgr.Grammar.from_structural_tag,
    }
    with grammar_errors(constraint):
        builders[constraint.kind](constraint.source)


@contextmanager
def grammar_errors(constraint: Constraint) -> Iterator[None]:
    """xgrammar's errors (RuntimeError, ValueError, its own subclasses) become a 400 naming the field."""
    try:
        yield
    except (RuntimeError, ValueError) as exc:
        text = str(exc).strip()
        detail = _XGR_PREFIX.sub("", text).splitlines()[0] if text else type(exc).__name__
        if len(detail) > _MAX_ERROR_CHARS:
            detail = detail[:_MAX_ERROR_CHARS] + "..."
        c = constraint
        raise InvalidRequestError(
            f"{c.param}: the {c.kind} cannot be used: {detail}", param=c.param
        ) from None
