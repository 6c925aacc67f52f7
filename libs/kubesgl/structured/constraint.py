"""Checking a request's grammar constraint (`kubesgl.values.constraint.Constraint`) where it enters.

`check_constraint` parses the source with xgrammar without a vocabulary (milliseconds, no token masks), so the
service that first sees a request can refuse a schema xgrammar cannot handle with a 400 naming the field,
before the request is admitted anywhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import contextmanager

from kubesgl.errors import InvalidRequestError, ServiceUnavailableError
from kubesgl.values.constraint import KINDS, Constraint, ConstraintKind

__all__ = ["KINDS", "Constraint", "ConstraintKind", "check_constraint", "grammar_errors"]

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed-check preamble.
_XGR_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_MAX_ERROR_CHARS = 300
# Consecutive whitespace allowed between JSON tokens (unbounded, some models emit newlines forever); here, not
# in compiler.py, so the services can name it without importing xgrammar (which imports torch).
DEFAULT_MAX_WHITESPACE = 16


def check_constraint(constraint: Constraint) -> None:
    """Raises InvalidRequestError naming `constraint.param` if xgrammar cannot build the grammar, and
    ServiceUnavailableError when this process cannot import xgrammar (it needs torch: an image without it)."""
    try:
        import xgrammar as xgr
    except ImportError as e:
        raise ServiceUnavailableError(
            f"{constraint.param}: this service cannot check grammars: xgrammar does not import here ({e}); "
            "its image needs xgrammar and the CPU torch wheel"
        ) from None

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
