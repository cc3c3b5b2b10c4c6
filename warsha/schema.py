"""Typed conversion of plain YAML data into dataclasses, collecting every problem at once.

Why not pydantic: the workbench must validate a recipe in well under a second and name each
problem by its recipe path (``stages[2].params.factor``); dataclasses with type hints plus a
small checker give exactly that with no extra dependency. Constraints live next to each field
as ``field(metadata=check(...))`` so that the schema documents itself.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable
from typing import Any, Literal, Union

Problem = str
Check = Callable[[Any], "str | None"]


def check(*checks: Check, help: str = "") -> dict[str, Any]:
    """Field metadata: constraint callables (each returns an error text or None) and help."""
    return {"checks": checks, "help": help}


def gt(bound: float) -> Check:
    """Constraint: strictly greater than ``bound``."""
    return lambda v: None if v > bound else f"must be > {bound}, got {v}"


def ge(bound: float) -> Check:
    """Constraint: greater than or equal to ``bound``."""
    return lambda v: None if v >= bound else f"must be >= {bound}, got {v}"


def le(bound: float) -> Check:
    """Constraint: less than or equal to ``bound``."""
    return lambda v: None if v <= bound else f"must be <= {bound}, got {v}"


def multiple_of(n: int) -> Check:
    """Constraint: an integer multiple of ``n``."""
    return lambda v: None if v % n == 0 else f"must be a multiple of {n}, got {v}"


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(tp))
        return f"{getattr(origin, '__name__', str(origin))}[{args}]"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is type(None):
        return "null"
    return getattr(tp, "__name__", str(tp))


def convert(tp: Any, value: Any, path: str, problems: list[Problem]) -> Any:
    """Convert ``value`` to type ``tp``; append ``path: message`` problems instead of raising."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin in (Union, types.UnionType):
        return _convert_union(tp, value, path, problems)
    if origin is Literal:
        if value in typing.get_args(tp):
            return value
        problems.append(f"{path}: must be one of {_type_name(tp)}, got {value!r}")
        return None
    if origin is list:
        return _convert_list(tp, value, path, problems)
    if origin is dict:
        return _convert_dict(tp, value, path, problems)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, path, problems)
    return _convert_scalar(tp, value, path, problems)


def _convert_union(tp: Any, value: Any, path: str, problems: list[Problem]) -> Any:
    args = typing.get_args(tp)
    if value is None and type(None) in args:
        return None
    for arg in args:
        if arg is type(None):
            continue
        trial: list[Problem] = []
        out = convert(arg, value, path, trial)
        if not trial:
            return out
    problems.append(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return None


def _convert_list(tp: Any, value: Any, path: str, problems: list[Problem]) -> Any:
    if not isinstance(value, (list, tuple)):
        problems.append(f"{path}: expected a list, got {type(value).__name__} {value!r}")
        return None
    (item,) = typing.get_args(tp) or (Any,)
    return [convert(item, v, f"{path}[{i}]", problems) for i, v in enumerate(value)]


def _convert_dict(tp: Any, value: Any, path: str, problems: list[Problem]) -> Any:
    if not isinstance(value, dict):
        problems.append(f"{path}: expected a mapping, got {type(value).__name__} {value!r}")
        return None
    _, val_tp = typing.get_args(tp) or (str, Any)
    return {str(k): convert(val_tp, v, f"{path}.{k}", problems) for k, v in value.items()}


# YAML 1.1 (PyYAML) reads a float without a dot, ``1e-4``, as a string: a learning rate written
# the way papers write it would otherwise be refused
_EXPONENT_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _convert_scalar(tp: Any, value: Any, path: str, problems: list[Problem]) -> Any:
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and _EXPONENT_FLOAT.fullmatch(value.strip()):
        return float(value)
    if tp in (int, float) and isinstance(value, bool):
        problems.append(f"{path}: expected {tp.__name__}, got bool {value!r}")
        return None
    if isinstance(tp, type) and isinstance(value, tp):
        return value
    problems.append(f"{path}: expected {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return None


def from_dict(cls: type, data: Any, path: str, problems: list[Problem]) -> Any:
    """Build dataclass ``cls`` from a mapping, reporting unknown, missing and invalid fields."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        problems.append(f"{path}: expected a mapping, got {type(data).__name__} {data!r}")
        return None
    start = len(problems)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    prefix = f"{path}." if path else ""
    for key in data:
        if key not in fields:
            known = ", ".join(sorted(fields)) or "none"
            problems.append(f"{prefix}{key}: unknown parameter (known: {known})")
    kwargs: dict[str, Any] = {}
    for name, f in fields.items():
        fpath = f"{prefix}{name}"
        # a nested section given as null (``fit: null``) keeps this field's default, not its
        # class's: the default factory may switch it off
        if name not in data or (data[name] is None and dataclasses.is_dataclass(hints[name])):
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                problems.append(f"{fpath}: required, missing")
            continue
        before = len(problems)
        value = convert(hints[name], data[name], fpath, problems)
        if len(problems) == before:
            for chk in f.metadata.get("checks", ()):
                if value is not None and (msg := chk(value)):
                    problems.append(f"{fpath}: {msg}")
        kwargs[name] = value
    try:
        obj = cls(**kwargs)
    except TypeError:
        return None
    validate = getattr(obj, "validate", None)
    if callable(validate) and len(problems) == start:
        problems.extend(f"{prefix}{p}" for p in validate())
    return obj


def to_dict(obj: Any) -> Any:
    """Plain-data form of a dataclass tree (for hashing and manifests)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: to_dict(v) for k, v in obj.items()}
    return obj


def describe(cls: type) -> list[tuple[str, str, Any, str]]:
    """(name, type, default, help) for each field: used by ``warsha stages`` help output."""
    hints = typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        default: Any = f.default
        if f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        elif default is dataclasses.MISSING:
            default = "(required)"
        rows.append((f.name, _type_name(hints[f.name]), default, f.metadata.get("help", "")))
    return rows
