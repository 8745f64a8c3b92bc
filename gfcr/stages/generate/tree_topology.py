"""The segment tree of a group of branched sequences (``generate.tree``): which leaves share which
response positions, read from who generated each position.

Every sequence ``q`` of a tree is a full response: a root sample (``fork = 0``, no source), or a
branch that copied positions ``[0, fork)`` of its ``source`` and sampled the rest itself. The
*owner* of position ``t`` of ``q`` is the sequence that sampled that token:
``owner(q, t) = q`` for ``t >= fork(q)``, else ``owner(source(q), t)``. Two leaves share a
position exactly when they have the same owner there (the same sampled token, not merely an
equal one), so the tree is the trie of the leaves' owner arrays, path-compressed:

- the root is the empty node above all the group's leaves (span ``(0, 0)``);
- a node covering leaves ``S`` from position ``a`` spans ``[a, b)``, ``b`` the first position
  where the owners of ``S`` differ (one leaf alone: to its end); its children partition ``S``
  by the owner at ``b``.

Node ids are ``n<owner>@<start>`` (the index of the sequence that sampled the node's first
token, and that position), unique within the group; the root is ``root``.

Example (sequence 1 branched from 0 at position 2, sequence 2 from 1 at position 3):

>>> tree = segment_tree([None, 0, 1], [0, 2, 3], [5, 4, 6], ["g/0", "g/1", "g/2"])
>>> tree.children
{'root': ['n0@0'], 'n0@0': ['n0@2', 'n1@2'], 'n1@2': ['n1@3', 'n2@3']}
>>> tree.spans["n0@0"], tree.spans["n1@2"], tree.spans["n2@3"]
((0, 2), (2, 3), (3, 6))
>>> tree.leaves["n1@2"]
['g/1', 'g/2']
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

from gfcr.records import TreeIndex

ROOT = "root"


def owners(sources: Sequence[int | None], forks: Sequence[int], lengths: Sequence[int]) -> list[list[int]]:
    """Per sequence, the index of the sequence that sampled each of its positions. A source must
    come before its branches."""
    out: list[list[int]] = []
    for q, (src, fork, n) in enumerate(zip(sources, forks, lengths)):
        if src is None:
            if fork != 0:
                raise ValueError(f"sequence {q} has no source but forks at {fork}")
            out.append([q] * n)
            continue
        if not 0 <= src < q or fork > len(out[src]) or fork > n:
            raise ValueError(f"sequence {q}: source {src} / fork {fork} is not an earlier sequence's prefix")
        out.append(out[src][:fork] + [q] * (n - fork))
    return out


def segment_tree(sources: Sequence[int | None], forks: Sequence[int], lengths: Sequence[int],
                 rollout_ids: Sequence[str]) -> TreeIndex:
    """The ``TreeIndex`` (children, leaves, spans) of the sequences (see the module docstring)."""
    own = owners(sources, forks, lengths)
    tree = TreeIndex()
    tree.leaves[ROOT] = list(rollout_ids)
    tree.spans[ROOT] = (0, 0)
    _split(tree, ROOT, list(range(len(own))), 0, own, rollout_ids)
    return tree


def _split(tree: TreeIndex, node: str, leaves: list[int], at: int, own: list[list[int]],
           rollout_ids: Sequence[str]) -> None:
    """Attach the children of ``node`` (whose segment ends at ``at``): its leaves grouped by owner there."""
    groups: dict[int, list[int]] = defaultdict(list)
    for q in leaves:
        if len(own[q]) <= at:
            raise ValueError(f"sequence {q} ends at {at} inside a segment other leaves continue")
        groups[own[q][at]].append(q)
    if len(groups) < 2 and node != ROOT:
        raise ValueError(f"node {node} would have a single child")  # _node extends a span instead
    tree.children[node] = []
    for owner, members in groups.items():
        child = _node(tree, members, at, owner, own, rollout_ids)
        tree.children[node].append(child)


def _node(tree: TreeIndex, members: list[int], start: int, owner: int, own: list[list[int]],
          rollout_ids: Sequence[str]) -> str:
    node = f"n{owner}@{start}"
    end = start
    if len(members) == 1:
        end = len(own[members[0]])
    else:
        while all(len(own[q]) > end for q in members) and len({own[q][end] for q in members}) == 1:
            end += 1
    tree.leaves[node] = [rollout_ids[q] for q in members]
    tree.spans[node] = (start, end)
    if len(members) > 1:
        _split(tree, node, members, end, own, rollout_ids)
    return node


def parents(tree: TreeIndex) -> dict[str, str]:
    """``node -> its parent`` for every non-root node."""
    return {child: node for node, children in tree.children.items() for child in children}
