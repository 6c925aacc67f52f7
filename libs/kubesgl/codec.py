"""Typed dataclasses to msgpack and back, by their declared field types (the wire protocol's codec).

A field may hold int, float, str, bool, bytes, an Enum, another dataclass, `X | None`, `tuple[X, ...]`,
`tuple[X, Y]`, a `Literal`, `list[X]`, `dict[K, V]` of those, or `JsonValue` (free-form JSON, checked where it enters and
carried as is). Encoding turns nested dataclasses into maps (msgpack packs enums, tuples and lists itself);
decoding checks every value against its field's type and rebuilds the dataclasses, so a wrong value is a
ProtocolError naming where it sits (`messages[0].content`), never a dict travelling on. Unknown keys are
ignored, except for the classes registered with `refuse_unknown_fields`. What to do with each field of a class
is worked out once, on first use.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from enum import Enum
from typing import Any, NewType, TypeVar

import msgpack

from kubesgl.errors import join_paths, param_path

# JSON as the client sent it (chat_template_kwargs, tool schemas): null, bool, number, string, list, object.
JsonValue = NewType("JsonValue", object)

T = TypeVar("T")
_Decode = Callable[[Any], Any]
_Encode = Callable[[Any], Any]
_SCALARS = (int, float, str, bool, bytes)


class ProtocolError(ValueError):
    """A body that is not a valid message of the expected type."""


class BadValueError(ProtocolError):
    """A value not of its field's type; `path` (`messages[0].content`) grows as the error leaves nested values."""

    def __init__(self, why: str, path: str = "") -> None:
        super().__init__(why)
        self.why, self.path = why, path

    def within(self, part: str | int) -> BadValueError:
        return BadValueError(self.why, join_paths(param_path("", part), self.path))

    def __str__(self) -> str:
        return f"{self.path} {self.why}" if self.path else self.why


class UnknownFieldsError(ProtocolError):
    """A map for a strict class (one whose every field changes what the receiver does) names fields it lacks."""

    def __init__(self, cls: type, unknown: list[str]) -> None:
        super().__init__(f"{cls.__name__} has no field(s) {', '.join(unknown)}")
        self.cls, self.unknown = cls, unknown


@dataclasses.dataclass(frozen=True)
class _Codec:
    names: frozenset[str]
    encoders: tuple[tuple[str, _Encode | None], ...]  # None: msgpack packs the value as it is
    exact: dict[str, tuple[type, ...]]  # fields taken as they come when of one of these types (ids, counts)
    nullable: dict[str, _Decode]  # `X | None` fields: X's decoder, called unless the value is None
    decoders: dict[str, _Decode]  # the other fields


_CODECS: dict[type, _Codec] = {}
_STRICT: set[type] = set()


def refuse_unknown_fields(*classes: type) -> None:
    """Decoding these dataclasses refuses unknown fields (UnknownFieldsError) instead of ignoring them: every
    field of theirs changes what the receiver does, so one it would drop is one it cannot honour."""
    _STRICT.update(classes)


def _codec(cls: type) -> _Codec:
    codec = _CODECS.get(cls)
    if codec is None:
        hints = typing.get_type_hints(cls)
        fields = [(f.name, hints[f.name]) for f in dataclasses.fields(cls)]
        exact = {n: t for n, tp in fields if (t := _exact_types(tp)) is not None}
        rest = [(n, tp) for n, tp in fields if n not in exact]
        codec = _Codec(
            frozenset(n for n, _ in fields),
            tuple((n, _encoder(tp)) for n, tp in fields),
            exact,
            {n: _decoder(inner) for n, tp in rest if (inner := _optional(tp)) is not None},
            {n: _decoder(tp) for n, tp in rest if _optional(tp) is None},
        )
        _CODECS[cls] = codec
    return codec


def encode_value(obj: Any) -> dict[str, Any]:
    """A dataclass as the map msgpack packs."""
    encoders = _codec(type(obj)).encoders
    return {name: getattr(obj, name) if enc is None else enc(getattr(obj, name)) for name, enc in encoders}


def decode_value(cls: type[T], body: Any) -> T:
    """Rebuilds a `cls` from its map, checking every field's type; ProtocolError when it does not fit."""
    try:
        return _decode_dataclass(cls, body)
    except BadValueError as e:
        raise ProtocolError(f"malformed {cls.__name__}: {e}") from None


def _decode_dataclass(cls: type[T], body: Any) -> T:
    if type(body) is not dict:
        raise BadValueError(f"must be a map, not {type(body).__name__}")
    codec = _codec(cls)
    exact, nullable, decoders = codec.exact, codec.nullable, codec.decoders
    kwargs = {}
    k = ""
    try:
        for (
            k,
            v,
        ) in body.items():  # the hot loop of every message: a scalar field costs one type test, no call
            if (types_ := exact.get(k)) is not None:
                if type(v) not in types_:  # not isinstance: a bool is no int here
                    raise BadValueError(f"must be {types_[0].__name__}, not {type(v).__name__}")
                kwargs[k] = v
            elif (dec := nullable.get(k)) is not None:
                kwargs[k] = None if v is None else dec(v)
            elif (dec := decoders.get(k)) is not None:
                kwargs[k] = dec(v)
    except BadValueError as e:
        raise e.within(str(k)) from None
    if len(kwargs) != len(body) and cls in _STRICT:
        raise UnknownFieldsError(cls, sorted(str(k) for k in body if k not in codec.names))
    try:
        return cls(**kwargs)
    except TypeError as e:  # a required field is missing
        raise BadValueError(f"is incomplete: {e}") from None


def pack(body: dict[str, Any]) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def unpack(data: bytes) -> dict[str, Any]:
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as e:  # msgpack raises several unrelated types for garbage input
        raise ProtocolError(f"body is not msgpack: {e}") from e
    if not isinstance(body, dict):
        raise ProtocolError(f"body is a {type(body).__name__}, expected a map")
    return body


def _optional(tp: Any) -> Any | None:
    """X for `X | None`, else None."""
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1 or len(args) != 2:
            raise TypeError(f"the codec carries X | None unions only, not {tp!r}")
        return rest[0]
    return None


def _exact_types(tp: Any) -> tuple[type, ...] | None:
    """The types a field of a plain scalar type (int, str, bool, bytes, or one of them | None) may arrive as."""
    inner = _optional(tp)
    base = inner if inner is not None else tp
    if base not in _SCALARS or base is float:  # an int arriving for a float is converted
        return None
    return (base, type(None)) if inner is not None else (base,)


def _encoder(tp: Any) -> _Encode | None:
    if (inner := _optional(tp)) is not None:
        enc = _encoder(inner)
        return None if enc is None else lambda v: None if v is None else enc(v)
    if dataclasses.is_dataclass(tp):
        return encode_value
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (tuple, list):
        encs = [_encoder(a) for a in args if a is not Ellipsis]
        if all(e is None for e in encs):
            return None
        if origin is list or (len(args) == 2 and args[1] is Ellipsis):  # list[X] has one arg: not a pair
            item = encs[0]
            assert item is not None
            return lambda v: [item(x) for x in v]
        return lambda v: [x if e is None else e(x) for e, x in zip(encs, v, strict=True)]
    if origin is dict:
        kenc, venc = (_encoder(a) for a in args)
        if kenc is None and venc is None:
            return None
        return lambda v: {
            (k if kenc is None else kenc(k)): (x if venc is None else venc(x)) for k, x in v.items()
        }
    return None  # scalars, enums (msgpack packs a str or int subclass as such) and JsonValue


def _decoder(tp: Any) -> _Decode:
    if (inner := _optional(tp)) is not None:
        dec = _decoder(inner)
        return lambda v: None if v is None else dec(v)
    if tp is JsonValue or tp is Any:
        return lambda v: v
    if tp in _SCALARS:
        return _scalar(tp)
    if isinstance(tp, type) and issubclass(tp, Enum):
        return _enum(tp)
    if typing.get_origin(tp) is typing.Literal:
        return _literal(typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return lambda v: _decode_dataclass(tp, v)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
        return _sequence(origin, args[0])
    if origin is tuple:
        return _fixed_tuple([_decoder(a) for a in args])
    if origin is dict:
        return _mapping(_decoder(args[0]), _decoder(args[1]))
    raise TypeError(f"the codec cannot carry {tp!r}")


def _scalar(tp: type) -> _Decode:
    if tp is float:

        def number(v: Any) -> float:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise BadValueError(f"must be a number, not {type(v).__name__}")

        return number

    def exact(v: Any) -> Any:
        if type(v) is tp:
            return v
        raise BadValueError(f"must be {tp.__name__}, not {type(v).__name__}")

    return exact


def _enum(tp: type[Enum]) -> _Decode:
    members = tp._value2member_map_

    def member(v: Any) -> Any:
        try:
            return members[v]
        except (KeyError, TypeError):
            raise BadValueError(f"must be one of {', '.join(map(repr, members))}, not {v!r:.40}") from None

    return member


def _literal(values: tuple[Any, ...]) -> _Decode:
    allowed = set(values)

    def literal(v: Any) -> Any:
        if type(v) in (str, int, bool) and v in allowed:
            return v
        raise BadValueError(f"must be one of {', '.join(map(repr, values))}, not {v!r:.40}")

    return literal


def _sequence(origin: type, item_type: Any) -> _Decode:
    build = tuple if origin is tuple else list
    if item_type in _SCALARS and item_type is not float:  # the hot path (token ids): no Python per item
        only = {item_type}

        def scalars(v: Any) -> Any:
            if type(v) not in (list, tuple) or not set(map(type, v)) <= only:
                raise BadValueError(f"must be an array of {item_type.__name__}, not {v!r:.60}")
            return build(v)

        return scalars
    item = _decoder(item_type)

    def items(v: Any) -> Any:
        if type(v) not in (list, tuple):
            raise BadValueError(f"must be an array, not {type(v).__name__}")
        out = []
        for i, x in enumerate(v):
            try:
                out.append(item(x))
            except BadValueError as e:
                raise e.within(i) from None
        return build(out)

    return items


def _fixed_tuple(decs: list[_Decode]) -> _Decode:
    def fixed(v: Any) -> tuple[Any, ...]:
        if type(v) not in (list, tuple) or len(v) != len(decs):
            raise BadValueError(f"must be an array of {len(decs)}, not {v!r:.40}")
        return tuple(d(x) for d, x in zip(decs, v, strict=True))

    return fixed


def _mapping(kdec: _Decode, vdec: _Decode) -> _Decode:
    def mapping(v: Any) -> dict[Any, Any]:
        if type(v) is not dict:
            raise BadValueError(f"must be a map, not {type(v).__name__}")
        out = {}
        for k, x in v.items():
            try:
                out[kdec(k)] = vdec(x)
            except BadValueError as e:
                raise e.within(k if isinstance(k, int) else str(k)[:40]) from None
        return out

    return mapping
