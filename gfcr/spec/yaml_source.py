"""Strict YAML reading with positions.

PyYAML composes the document into nodes that know their line and column; we build plain
Python data from those nodes ourselves, so that duplicate keys become errors (PyYAML keeps
the last silently) and every key path maps to a ``file:line:col``.

Scalars follow YAML 1.2's core schema rather than PyYAML's YAML 1.1 defaults: only
``true``/``false`` are booleans (``on``, ``yes`` and ``no`` stay strings), ``1e-4`` is a
float, and dates stay strings. Merge keys (``<<``) are refused; anchors and aliases work.

Hostile input is refused before it costs anything: nesting deeper than ``MAX_DEPTH`` stops the
scanner at the first bracket too deep and the composer at the first block node too deep
(PyYAML's composer recurses, so 100,000 brackets raised ``RecursionError``); a document whose
aliases would expand it past ``MAX_VALUES`` values (a "billion laughs" bomb: a few hundred bytes
that expand to 10^9 values) is refused after composing, which shares aliased nodes, and before
building, which would copy them. Both are problems with ``file:line:col``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from gfcr.errors import Location, Problem

KeyPath = tuple[str | int, ...]

_BOOL = "tag:yaml.org,2002:bool"
_FLOAT = "tag:yaml.org,2002:float"
_INT = "tag:yaml.org,2002:int"
_TIMESTAMP = "tag:yaml.org,2002:timestamp"


MAX_DEPTH = 64  # a pipeline nests about 6 deep
MAX_VALUES = 100_000  # values after alias expansion; a large pipeline has a few hundred


class _TooDeep(yaml.MarkedYAMLError):
    """Raised by the composer at the first node nested deeper than ``MAX_DEPTH``."""


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 core-schema booleans, ints and floats; it records each alias use
    and refuses nesting deeper than ``MAX_DEPTH`` as it composes."""

    def __init__(self, stream: str):
        super().__init__(stream)
        self.depth = 0
        self.aliases: list[tuple[str, yaml.Mark]] = []  # (anchor, where `*anchor` is written)
        self.anchored: dict[str, yaml.Node] = {}  # anchor -> its node (PyYAML forgets them after composing)

    def fetch_flow_collection_start(self, token_class: type) -> None:
        # the scanner looks ahead up to 1024 characters per flow level, which makes deep brackets
        # quadratic before the composer sees them: stop them as they are scanned
        if self.flow_level >= MAX_DEPTH:
            raise _TooDeep(problem=f"the document nests deeper than {MAX_DEPTH} levels",
                           problem_mark=self.get_mark())
        super().fetch_flow_collection_start(token_class)

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            self.aliases.append((event.anchor, event.start_mark))
            return super().compose_node(parent, index)
        if self.depth >= MAX_DEPTH:
            raise _TooDeep(problem=f"the document nests deeper than {MAX_DEPTH} levels",
                           problem_mark=self.peek_event().start_mark)
        anchor = self.peek_event().anchor
        self.depth += 1
        try:
            node = super().compose_node(parent, index)
        finally:
            self.depth -= 1
        if anchor is not None:
            self.anchored[anchor] = node
        return node


_Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag not in (_BOOL, _FLOAT, _INT, _TIMESTAMP)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(_BOOL, re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF"))
_Loader.add_implicit_resolver(_INT, re.compile(r"^[-+]?[0-9]+$"), list("-+0123456789"))
_Loader.add_implicit_resolver(
    _FLOAT,
    re.compile(r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
    list("-+0123456789."),
)


def _construct_scalar(loader: _Loader, node: yaml.ScalarNode) -> Any:
    if node.tag == _INT:
        return int(node.value.replace("_", ""))
    if node.tag == _FLOAT:
        text = node.value.lower()
        return float(text.replace(".inf", "inf").replace(".nan", "nan"))
    return loader.construct_object(node)


@dataclass
class SourceMap:
    """Key path -> where it was written. ``locate`` falls back to the nearest written parent."""

    file: str | None = None
    spans: dict[KeyPath, Location] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)  # what loading changed that the user should hear (a stage swap)

    def locate(self, path: KeyPath) -> Location:
        path = tuple(path)
        while path:
            if path in self.spans:
                return self.spans[path]
            path = path[:-1]
        return self.spans.get((), Location(self.file))

    def replace_subtree(self, path: KeyPath, where: Location) -> None:
        """Point ``path`` and everything below it at ``where`` (used by overrides)."""
        n = len(path)
        for key in [k for k in self.spans if k[:n] == path]:
            del self.spans[key]
        self.spans[path] = where


def _mark(file: str | None, mark: yaml.Mark) -> Location:
    return Location(file, mark.line + 1, mark.column + 1)


class _Builder:
    def __init__(self, loader: _Loader, file: str | None):
        self.loader, self.file = loader, file
        self.source = SourceMap(file)
        self.problems: list[Problem] = []

    def build(self, node: yaml.Node, path: KeyPath) -> Any:
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path)
        if isinstance(node, yaml.SequenceNode):
            items = []
            for i, item in enumerate(node.value):
                self.source.spans[path + (i,)] = _mark(self.file, item.start_mark)
                items.append(self.build(item, path + (i,)))
            return items
        return _construct_scalar(self.loader, node)

    def _mapping(self, node: yaml.MappingNode, path: KeyPath) -> dict[str, Any]:
        out: dict[str, Any] = {}
        first_seen: dict[str, Location] = {}
        for key_node, value_node in node.value:
            where = _mark(self.file, key_node.start_mark)
            dotted = ".".join(map(str, path))
            if key_node.tag == "tag:yaml.org,2002:merge":
                self.problems.append(Problem(where, dotted, "merge keys (`<<`) are not supported",
                                             "write the keys out, or use --set overrides for variants"))
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                self.problems.append(Problem(where, dotted, "a key must be a plain name, not a list or mapping",
                                             "use a plain string key"))
                continue
            key = str(key_node.value)
            child = path + (key,)
            if key in first_seen:
                self.problems.append(Problem(
                    where, ".".join(map(str, child)),
                    f"duplicate key `{key}` (first written at line {first_seen[key].line})",
                    f"keep one `{key}:` entry and delete the other",
                ))
                continue
            first_seen[key] = where
            value_where = _mark(self.file, value_node.start_mark)
            same_line = isinstance(value_node, yaml.ScalarNode) and value_where.line == where.line
            self.source.spans[child] = value_where if same_line else where
            out[key] = self.build(value_node, child)
        return out


def parse_yaml(text: str, file: str | None = None) -> tuple[Any, SourceMap, list[Problem]]:
    """Parse one YAML document into plain data, its source map and the problems found."""
    loader = _Loader(text)
    loader.name = file or "<string>"
    try:
        node = loader.get_single_node()
    except _TooDeep as exc:
        return None, SourceMap(file), [Problem(_mark(file, exc.problem_mark), "", str(exc.problem),
                                               "flatten the structure: a gfcr spec nests a few levels deep")]
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = _mark(file, mark) if mark else Location(file)
        message = " ".join(filter(None, [exc.context, exc.problem]))
        return None, SourceMap(file), [Problem(where, "", f"YAML syntax error: {message}",
                                               "check indentation (spaces, not tabs), colons and quotes here")]
    finally:
        loader.dispose()
    if node is None:
        return None, SourceMap(file), []
    if bomb := _alias_bomb(node, loader, file):
        return None, SourceMap(file), [bomb]
    builder = _Builder(loader, file)
    builder.source.spans[()] = _mark(file, node.start_mark)
    data = builder.build(node, ())
    return data, builder.source, builder.problems


def _alias_bomb(root: yaml.Node, loader: _Loader, file: str | None) -> Problem | None:
    """A problem if expanding the aliases would make more than ``MAX_VALUES`` values, at the alias
    that stands for the most; counted on the composed graph, where an aliased node is shared."""
    if not loader.aliases:
        return None
    sizes: dict[int, int] = {}

    def size(node: yaml.Node) -> int:  # depth is capped by the composer, so this recursion is bounded
        if id(node) not in sizes:
            children = node.value if isinstance(node, yaml.SequenceNode) else \
                [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else []
            sizes[id(node)] = 1 + sum(size(child) for child in children)
        return sizes[id(node)]

    if size(root) <= MAX_VALUES:
        return None
    anchor, mark = max(loader.aliases, key=lambda a: sizes.get(id(loader.anchored.get(a[0])), 0))
    stands_for = sizes.get(id(loader.anchored.get(anchor)), 0)
    return Problem(_mark(file, mark), "",
                   f"aliases would expand this document to {size(root):,} values, more than {MAX_VALUES:,} "
                   f"(`*{anchor}` here alone stands for {stands_for:,}): refused before expanding it",
                   "write the values out instead of nesting aliases of aliases; a gfcr spec has a few hundred values")


def parse_scalar(text: str) -> Any:
    """Parse an override value (``--set k=v``) with the same rules as the files."""
    data, _, problems = parse_yaml(text)
    if problems:
        raise ValueError(problems[0].message)
    return data
