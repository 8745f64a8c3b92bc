"""``--set KEY=VALUE`` overrides: typed, path-checked edits of the raw spec before validation.

A path must name a key the schema knows (``run.steps``) or an existing stage or loop
(``stages.pick.use``); any key may be set inside a ``with`` mapping, where the stage's own
Config validates it later. The value is parsed as YAML (``--set update.with.loss.with.clip=[0.2,0.28]``).

A stage swap (``--set stages.budget.use=control.coba``, a new ``use`` for a stage or the update)
keeps the stage's ``with`` keys the new stage's Config accepts and drops those it does not, with a
note naming them (``SourceMap.notes``); keys set by an override of the same command are always
kept, for the new Config to check. ``config_keys`` (given by the graph layer, which knows the
registry) says which keys a stage alias accepts.
"""

from __future__ import annotations

from typing import Any, Callable

from gfcr.errors import Location, Problem, did_you_mean, known
from gfcr.spec.problems import child_type, model_keys
from gfcr.spec.yaml_source import SourceMap, parse_scalar


def _open_mapping(annotation: Any) -> bool:
    """True for ``dict[str, Any]`` (a `with` block) and for anything inside one
    (``update.with.advantage.use``): any key goes, the stage's Config checks it later."""
    import typing

    if annotation is Any:
        return True
    return typing.get_origin(annotation) is dict and typing.get_args(annotation)[1] is Any


def _walk(root_type: Any, data: dict, keys: list[str], where: Location) -> tuple[Any, str] | Problem:
    """Find (container, last key) for ``keys``, creating empty mappings for absent model fields."""
    current, annotation = data, root_type
    for depth, key in enumerate(keys):
        so_far = ".".join(keys[: depth + 1])
        allowed = model_keys(annotation)
        if allowed is not None and key not in allowed:
            return Problem(where, so_far, f"`{key}` is not a key here",
                           did_you_mean(key, allowed) or f"the keys allowed here are {known(allowed)}")
        if allowed is None and not _open_mapping(annotation) and key not in current:
            names = list(current)
            return Problem(where, so_far, f"there is no `{key}` in `{'.'.join(keys[:depth]) or 'the spec'}`",
                           did_you_mean(key, names) or f"existing entries are {known(names)}")
        if depth == len(keys) - 1:
            return current, key
        annotation = child_type(annotation, key) if not _open_mapping(annotation) else Any
        if key not in current or current[key] is None:
            current[key] = {}
        if not isinstance(current[key], dict):
            return Problem(where, so_far, f"`{so_far}` is a value, not a mapping", f"set `{so_far}` itself")
        current = current[key]
    raise AssertionError("unreachable")


ConfigKeys = Callable[[str], "frozenset[str] | None"]  # a stage alias -> the keys its Config accepts (None: unknown)


def _swapped_entry(keys: list[str]) -> tuple[str, ...] | None:
    """The path of the stage entry whose ``use`` ``keys`` sets (``stages.budget``, ``update``), else None."""
    if keys[-1:] == ["use"] and (keys[:-1] == ["update"] or (len(keys) == 3 and keys[0] == "stages")):
        return tuple(keys[:-1])
    return None


def _entry(data: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        data = data.get(key) if isinstance(data, dict) else None
    return data


def _drop_unfit_keys(data: dict, swaps: dict[tuple[str, ...], str], set_paths: list[tuple[str, ...]],
                     source: SourceMap, config_keys: ConfigKeys) -> None:
    """After a stage swap, drop the old ``with`` keys the new stage does not accept (see the module doc)."""
    for path, text in swaps.items():
        entry = _entry(data, path)
        values = entry.get("with") if isinstance(entry, dict) else None
        accepted = config_keys(entry["use"]) if isinstance(entry.get("use"), str) else None
        if not isinstance(values, dict) or accepted is None or path + ("with",) in set_paths:
            continue
        dropped = [k for k in values if k not in accepted and path + ("with", k) not in set_paths]
        for key in dropped:
            del values[key]
        if dropped:
            where = ".".join(path)
            source.notes.append(f"--set {text}: dropped {', '.join(f'`{k}`' for k in dropped)} from `{where}.with`, "
                                f"which `{entry['use']}` does not accept; set its own keys with "
                                f"--set {where}.with.KEY=VALUE")


def apply_overrides(root_type: Any, data: dict, source: SourceMap, overrides: list[str],
                    config_keys: ConfigKeys | None = None) -> list[Problem]:
    """Apply ``KEY=VALUE`` strings to ``data`` in place; return the problems found."""
    problems: list[Problem] = []
    swaps: dict[tuple[str, ...], str] = {}  # stage entry -> the override that changed its `use`
    set_paths: list[tuple[str, ...]] = []
    for text in overrides:
        where = Location(f"--set {text}")
        key, sep, raw = text.partition("=")
        key = key.strip()
        if not sep or not key:
            problems.append(Problem(where, key, "an override must look like KEY=VALUE",
                                    "e.g. --set run.steps=20 or --set stages.pick.use=control.greso"))
            continue
        try:
            value = parse_scalar(raw) if raw.strip() else None
        except ValueError as exc:
            problems.append(Problem(where, key, f"the value `{raw}` is not valid YAML: {exc}",
                                    "quote strings with special characters: --set 'KEY=\"value\"'"))
            continue
        found = _walk(root_type, data, key.split("."), where)
        if isinstance(found, Problem):
            problems.append(found)
            continue
        container, last = found
        entry = _swapped_entry(key.split("."))
        if entry is not None and container.get(last) != value:
            swaps[entry] = text
        container[last] = value
        path = tuple(key.split("."))
        set_paths.append(path)
        source.replace_subtree(path, where)
        for depth in range(1, len(path)):  # a mapping the override created points at it too
            source.spans.setdefault(path[:depth], where)
    if config_keys is not None and not problems:
        _drop_unfit_keys(data, swaps, set_paths, source, config_keys)
    return problems
