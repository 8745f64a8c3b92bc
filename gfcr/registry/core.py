"""One generic registry: names -> objects, registered eagerly, lazily (``module:attr``) or by
third-party packages through an entry-point group.

Lookups of unknown names say "did you mean"; two different objects under one name are an
error naming both origins. Lazy targets are imported only when first looked up, so listing
names is cheap.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from importlib import metadata
from typing import Callable, Generic, Iterator, TypeVar, overload

from gfcr.errors import RegistryError, did_you_mean, known

T = TypeVar("T")


@dataclass
class _Entry(Generic[T]):
    target: str | None  # "module:attr" for lazy entries
    obj: T | None
    origin: str  # the distribution that registered it ("gfcr" for built-ins)


def _target_of(obj: object) -> str:
    return f"{getattr(obj, '__module__', '?')}:{getattr(obj, '__qualname__', '?')}"


class Registry(Generic[T]):
    """Names of one kind (``stage``, ``data source``, ...) mapped to objects of type ``T``."""

    def __init__(self, kind: str, entry_point_group: str | None = None,
                 check: Callable[[str, T, str], object] | None = None, check_lazy: bool = False,
                 unknown_fix: Callable[[str], str] | None = None):
        self.kind = kind
        self.unknown_fix = unknown_fix  # how to make an unknown name known, after the did-you-mean
        self.entry_point_group = entry_point_group
        self.check = check  # called as check(name, obj, origin) on eager registration; raises RegistryError
        self.check_lazy = check_lazy  # and on a lazy entry's first lookup, once it is imported
        self._entries: dict[str, _Entry[T]] = {}
        self._entry_points_loaded = entry_point_group is None
        self._entry_point_error: RegistryError | None = None

    @overload
    def register(self, name: str) -> Callable[[T], T]: ...
    @overload
    def register(self, name: str, obj: T, *, origin: str = ...) -> T: ...

    def register(self, name, obj=None, *, origin="__main__"):
        """Register ``obj`` under ``name``; without ``obj``, return a class decorator."""
        if obj is None:
            return lambda o: self.register(name, o, origin=getattr(o, "__module__", origin).split(".")[0])
        existing = self._entries.get(name)
        if existing is not None:
            if existing.obj is obj or (existing.obj is None and existing.target == _target_of(obj)):
                existing.obj = obj  # a lazy entry whose module registers itself on import
                return obj
            raise RegistryError(
                f"{self.kind} `{name}` is registered twice: by {existing.origin} "
                f"({existing.target or _target_of(existing.obj)}) and by {origin} ({_target_of(obj)})",
                "rename one of them; aliases are public API and must be unique",
            )
        if self.check is not None:
            self.check(name, obj, origin)
        self._entries[name] = _Entry(None, obj, origin)
        return obj

    def register_lazy(self, name: str, target: str, *, origin: str) -> None:
        """Register ``module:attr``, imported on first lookup."""
        if ":" not in target:
            raise RegistryError(f"{self.kind} `{name}`: target `{target}` is not `module:attr`",
                                "write the target as `package.module:ClassName`")
        existing = self._entries.get(name)
        if existing is not None and (existing.target or _target_of(existing.obj)) != target:
            raise RegistryError(
                f"{self.kind} `{name}` is registered twice: by {existing.origin} "
                f"({existing.target or _target_of(existing.obj)}) and by {origin} ({target})",
                f"uninstall one of the two packages, or rename the {self.kind} in one of them",
            )
        if existing is None:
            self._entries[name] = _Entry(target, None, origin)

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            if self._entry_point_error is not None:
                raise self._entry_point_error  # a collision stays an error on every lookup
            return
        self._entry_points_loaded = True
        for ep in metadata.entry_points(group=self.entry_point_group):
            origin = ep.dist.name if ep.dist is not None else "unknown package"
            try:
                self.register_lazy(ep.name, ep.value, origin=origin)
            except RegistryError as exc:
                self._entry_point_error = exc
                raise

    def __contains__(self, name: object) -> bool:
        self._load_entry_points()
        return name in self._entries

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    def origin(self, name: str) -> str:
        self.get(name)
        return self._entries[name].origin

    def get(self, name: str) -> T:
        """The object registered as ``name``, importing it if lazy."""
        self._load_entry_points()
        entry = self._entries.get(name)
        if entry is None:
            fix = did_you_mean(name, self._entries) or f"known {self.kind}s: {known(self._entries)}"
            if self.unknown_fix is not None:
                fix += (" Or, " if fix.endswith("?") else "; or, ") + self.unknown_fix(name)
            raise RegistryError(f"unknown {self.kind} `{name}`", fix)
        if entry.obj is None:
            obj = self._import(name, entry.target)
            if self.check is not None and self.check_lazy:
                self.check(name, obj, entry.origin)
            entry.obj = obj
        return entry.obj

    def _import(self, name: str, target: str) -> T:
        module_name, _, attr = target.partition(":")
        try:
            obj = importlib.import_module(module_name)
            for part in attr.split("."):
                obj = getattr(obj, part)
        except (ImportError, AttributeError) as exc:
            raise RegistryError(f"{self.kind} `{name}` points at `{target}`, which cannot be imported: {exc}",
                                f"check that the package providing `{module_name}` is installed") from exc
        return obj  # type: ignore[return-value]
