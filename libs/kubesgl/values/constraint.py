"""The grammar constraint one request carries (structured outputs): what kind (JSON schema, any JSON object,
regex, EBNF, or an xgrammar structural tag for tool calls) and its source text. A plain value carried in
`SamplingParams.constraint` from the HTTP edge to the scheduler, where it is compiled against the vocabulary
(`kubesgl.structured`); `kubesgl.structured.constraint.check_constraint` parses it at the edge."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

from kubesgl.errors import InvalidRequestError

ConstraintKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]
KINDS: tuple[str, ...] = get_args(ConstraintKind)
MAX_SOURCE_CHARS = 256 * 1024  # a schema this long is a mistake or an attack; compile time grows with it


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
