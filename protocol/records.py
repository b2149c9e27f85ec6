"""Frozen dataclasses as plain msgpack maps and back, by their type hints.

:func:`plain` turns a dataclass (jobs, the checked params of :mod:`protocol.params`) into a map of
its fields that are set, nested dataclasses as maps and tuples as arrays. :func:`record` builds one
back from such a map, checking each value against the field's type (a map is untrusted bytes) and
without running ``__init__`` (a value from the wire was validated where it was made). Each class's
schema is derived once, from its type hints: a new field needs no change here.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")
Convert = Callable[[Any], Any]

_MISSING = dataclasses.MISSING


def plain(value: Any) -> Any:
    """``value`` as msgpack takes it: a dataclass as the map of its fields that are not None (or
    are None where that is not their default)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        cls = type(value)
        keep = _KEEP_NONE.get(cls)
        if keep is None:
            keep = _KEEP_NONE[cls] = frozenset(
                f.name for f in dataclasses.fields(cls) if f.default is not None
            )
        return {k: plain(v) for k, v in value.__dict__.items() if v is not None or k in keep}
    if type(value) is tuple:
        return [plain(v) for v in value]
    return value


@dataclasses.dataclass(frozen=True)
class _Schema:
    """How to build one dataclass: for each field the types it takes as they are (None: any) and
    its converter (which checks); a template of its values in field order (the defaults; _MISSING
    where a field is required, _FACTORY where its default is made fresh)."""

    fields: dict[str, tuple[frozenset[type] | None, Convert]]
    template: dict[str, Any]
    required: tuple[tuple[str, Convert], ...]
    factories: tuple[tuple[str, Callable[[], Any]], ...]


_SCHEMAS: dict[type, _Schema] = {}
_KEEP_NONE: dict[type, frozenset[str]] = {}
_FACTORY = object()


def record(cls: type[T], data: Any) -> T:
    """An instance of dataclass ``cls`` from ``data`` (a :func:`plain` map); ValueError naming the
    field when a value is not of its type or a required one is missing. Unknown keys are ignored."""
    if type(data) is not dict:
        raise ValueError(f"{cls.__name__} must be a map")
    schema = _SCHEMAS.get(cls) or _schema(cls)
    fields = schema.fields
    converted: dict[str, Any] | None = None
    known = True
    for name, value in data.items():
        spec = fields.get(name)
        if spec is None:
            known = False
        elif spec[0] is not None and type(value) not in spec[0]:
            if converted is None:
                converted = {}
            converted[name] = spec[1](value)
    if known:
        values = {**schema.template, **data}
    else:
        values = dict(schema.template)
        values.update((k, v) for k, v in data.items() if k in fields)
    if converted:
        values.update(converted)
    for name, convert in schema.required:
        if values[name] is _MISSING:
            values[name] = convert(None)  # None where the type allows it, else ValueError
    for name, factory in schema.factories:
        if values[name] is _FACTORY:
            values[name] = factory()
    obj = object.__new__(cls)
    object.__setattr__(obj, "__dict__", values)
    return obj


def _schema(cls: type) -> _Schema:
    hints = typing.get_type_hints(cls)
    fields: dict[str, tuple[frozenset[type] | None, Convert]] = {}
    template: dict[str, Any] = {}
    required: list[tuple[str, Convert]] = []
    factories: list[tuple[str, Callable[[], Any]]] = []
    for f in dataclasses.fields(cls):
        convert = _converter(hints[f.name], f"{cls.__name__}.{f.name}")
        fields[f.name] = (_as_is(hints[f.name]), convert)
        if f.default is not _MISSING:
            template[f.name] = f.default
        elif f.default_factory is not _MISSING:
            template[f.name] = _FACTORY
            factories.append((f.name, f.default_factory))
        else:
            template[f.name] = _MISSING
            required.append((f.name, convert))
    schema = _SCHEMAS[cls] = _Schema(fields, template, tuple(required), tuple(factories))
    return schema


_PLAIN = (str, int, bool, bytes, float, dict)


def _as_is(tp: Any) -> frozenset[type] | None:
    """The types a value of ``tp`` comes in that need no conversion (None: any value)."""
    if tp is Any:
        return None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        kinds: set[type] = set()
        for a in args:
            if a is type(None):
                kinds.add(type(None))
                continue
            inner = _as_is(a)
            if inner is None:
                return None
            kinds |= inner
        return frozenset(kinds)
    if tp in _PLAIN:
        return frozenset({tp})
    if origin is dict:
        return frozenset({dict})
    return frozenset()  # converted: tuples, lists, nested records


def _fail(where: str, value: Any) -> ValueError:
    shown = repr(value)
    return ValueError(f"{where} is {shown[:60]}{'...' if len(shown) > 60 else ''}")


def _converter(tp: Any, where: str) -> Convert:  # noqa: C901 - one branch per kind of type
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in args if a is not type(None)]
        one = _converter(inner[0], where) if len(inner) == 1 else _any_of(inner, where)
        nullable = len(inner) < len(args)

        def optional(v: Any) -> Any:
            if v is None:
                if nullable:
                    return None
                raise _fail(where, v)
            return one(v)

        return optional
    if tp is Any:
        return lambda v: v
    if tp is float:

        def to_float(v: Any) -> float:
            if type(v) is float:
                return v
            if type(v) is int:
                return float(v)
            raise _fail(where, v)

        return to_float
    if tp in (str, int, bool, bytes):

        def exact(v: Any) -> Any:
            if type(v) is not tp:
                raise _fail(where, v)
            return v

        return exact
    if origin is tuple:
        each = _converter(args[0], where)

        def to_tuple(v: Any) -> tuple[Any, ...]:
            if type(v) is not list:
                raise _fail(where, v)
            return tuple(each(x) for x in v)

        return to_tuple
    if origin is list:
        each = _converter(args[0], where)

        def to_list(v: Any) -> list[Any]:
            if type(v) is not list:
                raise _fail(where, v)
            return [each(x) for x in v]

        return to_list
    if origin is dict or tp is dict:

        def to_dict(v: Any) -> dict[Any, Any]:
            if type(v) is not dict:
                raise _fail(where, v)
            return v

        return to_dict
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        cls: type[Any] = tp
        return lambda v: record(cls, v)
    raise TypeError(f"{where}: no wire form for {tp!r}")


def _any_of(options: list[Any], where: str) -> Convert:
    converters = [_converter(o, where) for o in options]

    def first(v: Any) -> Any:
        for c in converters:
            try:
                return c(v)
            except ValueError:
                continue
        raise _fail(where, v)

    return first
