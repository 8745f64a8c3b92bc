"""List every import cycle in gfcr/, or say there is none (``make lint`` runs it, and so does
``tests/test_import_cycles.py``).

Usage: python scripts/import_cycles.py [--package NAME] [--all]

The import graph is grimp's, the one import-linter checks: imports at module level, inside
functions and under ``TYPE_CHECKING`` all count. Two kinds of cycle are listed:

- a module cycle: modules that import each other, directly or around a loop (a strongly
  connected component of the module graph), with every import inside it (module:line);
- a package cycle: children of one package whose subtrees import each other, e.g.
  ``gfcr.stages.filter -> gfcr.stages.control -> gfcr.stages.filter`` (what import-linter's
  ``acyclic_siblings`` contract forbids), with every import that makes an edge of it.

Inside the packages of ``EXCLUDED`` nothing is checked (without ``--all``): their children may
import each other, and a module cycle is listed unless all its modules are inside them. The
package itself is still one node of its parent's check. Exit status 1 when a cycle is listed.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field

import grimp
import networkx as nx

# Packages whose insides are not checked (none: gfcr.stages is checked since its families stopped
# importing each other, issue 27). A package added here is skipped by pyproject.toml's
# acyclic_siblings contract too (`skip_descendants`).
EXCLUDED: tuple[str, ...] = ()


@dataclass
class Cycle:
    """One group of modules (or of a package's children) that import each other."""

    kind: str  # "module cycle" or "package cycle in <package>"
    members: list[str]
    loop: list[str]  # one loop through the group, first member repeated at the end
    imports: list[str] = field(default_factory=list)  # "importer:line imports imported", every one inside the group

    def describe(self) -> str:
        head = f"{self.kind} ({len(self.members)} members): {' -> '.join(self.loop)}"
        return "\n".join([head, *(f"    {line}" for line in self.imports)])


def find_cycles(package: str, excluded: tuple[str, ...] = ()) -> tuple[list[Cycle], int]:
    """Every module cycle and package cycle in ``package``, and how many modules it has."""
    graph = grimp.build_graph(package, cache_dir=None)
    edges = [(importer, imported) for importer in sorted(graph.modules)
             for imported in sorted(graph.find_modules_directly_imported_by(importer))]
    cycles = _module_cycles(graph, edges, excluded)
    for parent in sorted(m for m in graph.modules if graph.find_children(m) and not _inside(m, excluded)):
        cycles += _package_cycles(graph, edges, parent)
    return cycles, len(graph.modules)


def _module_cycles(graph: grimp.ImportGraph, edges: list[tuple[str, str]], excluded: tuple[str, ...]) -> list[Cycle]:
    modules = nx.DiGraph(edges)
    cycles = []
    for group in _groups(modules):
        if all(_inside(m, excluded) for m in group):
            continue
        inside = [(a, b) for a, b in edges if a in group and b in group]
        cycles.append(Cycle("module cycle", group, _loop(modules.subgraph(group)), _import_lines(graph, inside)))
    return cycles


def _package_cycles(graph: grimp.ImportGraph, edges: list[tuple[str, str]], parent: str) -> list[Cycle]:
    """Cycles among the children of ``parent``: child A -> child B when a module of A's subtree
    imports one of B's. A cycle of plain modules is a module cycle, listed as one."""
    between: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for a, b in edges:
        child_a, child_b = _child(parent, a), _child(parent, b)
        if child_a and child_b and child_a != child_b:
            between.setdefault((child_a, child_b), []).append((a, b))
    children = nx.DiGraph(list(between))
    return [Cycle(f"package cycle in {parent}", group, _loop(children.subgraph(group)),
                  _import_lines(graph, [e for pair, found in sorted(between.items())
                                        if pair[0] in group and pair[1] in group for e in found]))
            for group in _groups(children) if any(graph.find_children(m) for m in group)]


def _groups(graph: nx.DiGraph) -> list[list[str]]:
    """The strongly connected components of more than one node, each sorted, in name order."""
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def _loop(group: nx.DiGraph) -> list[str]:
    """One loop through ``group``, from its first node in name order back to it."""
    start = min(group.nodes)
    loop = [a for a, _ in nx.find_cycle(group, source=start)]
    at = loop.index(min(loop))
    return loop[at:] + loop[:at] + [min(loop)]


def _import_lines(graph: grimp.ImportGraph, edges: list[tuple[str, str]]) -> list[str]:
    return [f"{d['importer']}:{d['line_number']} imports {d['imported']}"
            for a, b in edges for d in graph.get_import_details(importer=a, imported=b)]


def _child(parent: str, module: str) -> str | None:
    """The child of ``parent`` that ``module`` is or is inside; None outside ``parent``."""
    if not module.startswith(parent + "."):
        return None
    return parent + "." + module[len(parent) + 1:].split(".")[0]


def _inside(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--package", default="gfcr", help="the package to check (default: gfcr)")
    parser.add_argument("--all", action="store_true", help=f"check inside {', '.join(EXCLUDED)} too")
    args = parser.parse_args(argv)
    excluded = () if args.all else tuple(p for p in EXCLUDED if _inside(p, (args.package,)))
    cycles, count = find_cycles(args.package, excluded)
    where = args.package.replace(".", "/") + "/"
    if not cycles:
        unchecked = f"; not checked inside {', '.join(excluded)}" if excluded else ""
        print(f"no import cycle in {where} ({count} modules{unchecked})")
        return 0
    for cycle in cycles:
        print(cycle.describe())
    print(f"{len(cycles)} import cycle(s) in {where}")
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
