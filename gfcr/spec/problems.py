"""Turning pydantic validation errors into gfcr ``Problem``s with a location, a key path and a fix."""

from __future__ import annotations

import re
import types
import typing
from typing import Any, Iterable

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from gfcr.errors import Problem, did_you_mean, known
from gfcr.spec.yaml_source import KeyPath, SourceMap

_TYPE_WORDS = {
    "int_type": "an integer", "float_type": "a number", "bool_type": "`true` or `false`",
    "string_type": "a string", "dict_type": "a mapping", "list_type": "a list", "tuple_type": "a list",
    "model_type": "a mapping", "int_from_float": "an integer", "model_attributes_type": "a mapping",
}
BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than", "too_short", "too_long")
FIXABLE = "gfcr_fixable"  # the error type of `fixable`


def fixable(message: str, fix: str) -> PydanticCustomError:
    """A validator's error that carries its fix: raise it where a ValueError would go, and
    ``gfcr validate`` prints the fix on its own ``fix:`` line (``str()`` shows both)."""
    return PydanticCustomError(FIXABLE, "{message}; {fix}", {"message": message, "fix": fix})


def dotted(path: Iterable[str | int]) -> str:
    return ".".join(str(p) for p in path)


def _unwrap(annotation: Any) -> list[Any]:
    """The concrete types inside Optional / Union / Annotated."""
    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _unwrap(typing.get_args(annotation)[0])
    if origin in (typing.Union, types.UnionType):
        return [t for a in typing.get_args(annotation) for t in _unwrap(a) if t is not type(None)]
    return [annotation]


def child_type(parent: Any, key: str | int) -> Any | None:
    """The declared type at ``parent[key]``: a model field, a dict value or a list item."""
    for t in _unwrap(parent):
        if isinstance(t, type) and issubclass(t, BaseModel):
            for name, f in t.model_fields.items():
                if key in (name, f.alias):
                    return f.annotation
            return None
        origin = typing.get_origin(t)
        if origin is dict and isinstance(key, str):
            return typing.get_args(t)[1]
        if origin in (list, tuple) and isinstance(key, int):
            return typing.get_args(t)[0]
    return None


def type_at(root: type[BaseModel], path: KeyPath) -> Any | None:
    current: Any = root
    for key in path:
        current = child_type(current, key)
        if current is None:
            return None
    return current


def model_keys(annotation: Any) -> list[str] | None:
    """The YAML keys a model accepts, or None when ``annotation`` is not a model."""
    for t in _unwrap(annotation):
        if isinstance(t, type) and issubclass(t, BaseModel):
            return [f.alias or name for name, f in t.model_fields.items()]
    return None


def _clean_loc(loc: tuple, data: Any) -> KeyPath:
    """Drop pydantic's union and key tags, keeping the path as the user wrote it."""
    path: list[str | int] = []
    current = data
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(current, dict) and part in current:
            path.append(part)
            current = current[part]
        elif isinstance(current, list) and isinstance(part, int) and part < len(current):
            path.append(part)
            current = current[part]
        elif last and isinstance(current, dict) and part != "[key]":
            path.append(part)
    return tuple(path)


def _fix(err: dict, path: KeyPath, root: type[BaseModel]) -> tuple[str, str | None]:
    kind, msg = err["type"], err["msg"].removeprefix("Value error, ")
    key = path[-1] if path else ""
    if kind == FIXABLE:
        return err["ctx"]["message"], err["ctx"]["fix"]
    if kind == "extra_forbidden":
        owner = type_at(root, path[:-1])
        moved = getattr(owner, "moved_keys", {}).get(str(key))  # a key a Config had before, and where it went
        if moved:
            return f"`{key}` is no longer a key here", moved
        allowed = model_keys(owner) or []
        hint = did_you_mean(str(key), allowed)
        return f"unknown key `{key}`", hint or f"remove `{key}`; the keys allowed here are {known(allowed)}"
    if kind == "missing":
        return f"required key `{key}` is missing", f"add `{key}:` here"
    if kind in _TYPE_WORDS:
        got = f"{type(err['input']).__name__} `{err['input']!r}`"
        note = {"string_type": " (quote it)", "int_type": " (no quotes, no decimal point)",
                "float_type": " (no quotes)", "bool_type": " (no quotes)"}.get(kind, "")
        return f"expected {_TYPE_WORDS[kind]}, got {got}", f"write {_TYPE_WORDS[kind]} here{note}"
    if kind == "value_error" and path and path[-1] == "from":
        return msg, "write `from: pick`, `from: [pick, replay]` or `from: {allocation: pick}`"
    if kind == "literal_error":
        options = re.findall(r"'([^']*)'", err["ctx"]["expected"]) if "ctx" in err else []
        hint = did_you_mean(str(err["input"]), options) if isinstance(err["input"], str) else None
        return f"`{err['input']}` is not one of {known(options)}", hint or f"use one of {known(options)}"
    if kind == "string_pattern_mismatch":
        if "[key]" in err["loc"]:
            return (f"`{err['input']}` is not a valid name",
                    "names use letters, digits and `_`, and start with a letter or `_`")
        return f"`{err['input']}` does not have the required form", _pattern_fix(err["ctx"]["pattern"])
    if kind == "finite_number":
        return (f"`{key}` must be a finite number, got `{err['input']!r}`",
                "write a finite number here: `.inf`, `-.inf` and `.nan` cannot run")
    if kind in BOUNDS and key == "seed":
        return f"a seed is a non-negative integer, got `{err['input']!r}`", "write 0 or a positive integer"
    if kind in BOUNDS:
        return f"{msg}, got `{err['input']!r}`", "change the value to satisfy the bound"
    return msg, None


def _pattern_fix(pattern: str) -> str:
    if "\\." in pattern:
        return "name a registered stage as `<family>.<name>`, e.g. `control.uniform` (see `gfcr stages`)"
    return "use letters, digits and `_`, starting with a letter or `_`"


def problems_from_validation(exc: ValidationError, root: type[BaseModel], data: Any, source: SourceMap,
                             prefix: KeyPath = ()) -> list[Problem]:
    """One Problem per pydantic error, located with ``source`` under ``prefix``."""
    problems = []
    for err in exc.errors(include_url=False):
        path = _clean_loc(tuple(err["loc"]), data)
        message, fix = _fix(err, path, root)
        full = prefix + path
        problems.append(Problem(source.locate(full), dotted(full), message, fix))
    return problems
