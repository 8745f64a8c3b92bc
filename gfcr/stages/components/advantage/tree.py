"""advantage ``tree``: TreeRL's per-token process advantages over a tree group.

TreeRL (Hou et al., arXiv 2506.11902; seed_methods 3.2 and 6.6; ``THUDM/TreeRL``,
``compute_weighted_update(..., "sqrt")``).

The group is a tree (``RolloutGroup.tree``, as ``generate.tree`` writes it): each node ``s``
is a span of response positions shared by the leaves below it, ``L(s)``; the leaves are the
group's rollouts, scored by the verifier. The rules:

    V(s)    = mean reward of the leaves in L(s)            (node value; V(root) = the group mean)
    A(s)    = [ (V(s) - V(root)) + (V(s) - V(parent(s))) ] / sqrt(|L(s)|)
              global advantage  + local advantage,  over the square root of the leaves below s

and every token of the segment of ``s`` inherits ``A(s)``: leaf ``r``'s advantage at position
``t`` is ``A(s)`` for the node ``s`` on ``r``'s path whose span holds ``t``. The advantages are
per token (``[T]``), with no loss mask; the update counts a shared position once
(``tree_weights``: weight ``1/|L(s)|`` in each of the ``|L(s)|`` leaves), so a segment's
contribution to the loss is ``A(s)`` times its tokens, once.

A node's span is read from ``TreeIndex.spans`` when the tree has them; otherwise from the
tokens (a node ends where its leaves stop agreeing; a single-leaf node at the leaf's end; it
starts where its parent ends). A node without a parent in ``children`` hangs from the root,
whose value is the group mean; the root itself (the node over every leaf) gets ``A = 0``.

``gfcr validate`` refuses ``tree`` unless a ``generate.tree`` stage is upstream of the update;
a group without a tree at run time raises ValueError naming it. The other way round is allowed:
a tree group reaching a scalar estimator (``mean_std``, ...) is treated as a group of its leaves
(each leaf a sample, shared prefixes counted once by ``tree_weights``): a valid, if
tree-unaware, group baseline, and TreeRL's own "tree sampling, outcome advantage" ablation.

Deviations:
- this is the formula of the paper and of the research note; the reference repository's
  experience maker first centres each leaf's reward on the mean of the *other* leaves
  (``leaf_normalize``), accumulates those values upward and divides by ``sqrt`` of the leaves
  *selected* for training (``selected_terminal_in_subtree``); here every leaf is in the update
  and the values are plain means of rewards;
- with unequal rewards only (every leaf equal gives every ``A = 0``, as any group baseline);
  unscored leaves raise ValueError naming the group.

Example (leaves ``[1, 0, 1]``; node ``a`` holds leaves 0 and 1, spans from the tokens):

>>> from gfcr.records import Rollout, RolloutGroup, Segment, TreeIndex
>>> def leaf(i, tokens, reward):
...     return Rollout(f"g/{i}", "g", "p", tokens, [Segment(0, len(tokens), 0, [0.0] * len(tokens))], reward=reward)
>>> leaves = [leaf(0, [3, 4, 5, 6], 1.0), leaf(1, [3, 4, 5, 7], 0.0), leaf(2, [3, 8, 9], 1.0)]
>>> tree = TreeIndex(children={"root": ["a", "c"], "a": ["x", "y"]},
...                  leaves={"root": ["g/0", "g/1", "g/2"], "a": ["g/0", "g/1"], "x": ["g/0"], "y": ["g/1"], "c": ["g/2"]})
>>> out = TreeAdvantage(TreeAdvantage.Config()).estimate(RolloutGroup("g", "p", 0, 3, leaves, tree=tree))
>>> [[round(float(v), 3) for v in a] for a in out.values]
[[0.0, -0.236, -0.236, 0.833], [0.0, -0.236, -0.236, -1.167], [0.0, 0.667, 0.667]]

YAML:

.. code-block:: yaml

    rollout: {use: generate.tree, from: budget, with: {top_n: 2, iterations: 1, branches: 2}}
    update:  {use: update.grpo, from: reward, with: {advantage: {use: tree}}}
"""

from __future__ import annotations

import math

import numpy as np
from pydantic import Field

from gfcr.records import Rollout, RolloutGroup
from gfcr.registry import PipelineProblem
from gfcr.stages.components.advantage.base import Advantages, EstimatorConfig, checked_rewards
from gfcr.stages.components.base import PairingContext


def _agreed_length(leaves: list[Rollout]) -> int:
    """How many leading positions every one of ``leaves`` has, with the same tokens."""
    if len(leaves) == 1:
        return len(leaves[0])
    n = 0
    shortest = min(len(r) for r in leaves)
    while n < shortest and len({r.response_token_ids[n] for r in leaves}) == 1:
        n += 1
    return n


class TreeAdvantage:
    """TreeRL: per-segment (V(s) - V(root) + V(s) - V(parent)) / sqrt(|leaves(s)|), per token."""

    class Config(EstimatorConfig):
        leaf_scaling: bool = Field(True, description="divide each node's advantage by sqrt(|leaves(s)|) "
                                                     "(TreeRL's `sqrt`; false: the `original` variant)")

    def __init__(self, config: Config):
        self.config = config

    def node_values(self, group: RolloutGroup) -> tuple[dict[str, float], float]:
        """``(V(s) per node with leaves in the group, V(root) = the group mean)``."""
        rewards = dict(zip((r.rollout_id for r in group.rollouts), checked_rewards(group)))
        values = {}
        for node, ids in self._tree(group).leaves.items():
            present = [rewards[i] for i in ids if i in rewards]
            if present:
                values[node] = float(np.mean(present))
        return values, float(np.mean(list(rewards.values()))) if rewards else 0.0

    def node_advantages(self, group: RolloutGroup) -> dict[str, float]:
        """``A(s)`` per node (see the module docstring)."""
        tree = self._tree(group)
        values, root = self.node_values(group)
        parent = {c: p for p, children in tree.children.items() for c in children}
        present = {r.rollout_id for r in group.rollouts}
        out = {}
        for node, v in values.items():
            up = values.get(parent[node], root) if node in parent else root
            n = sum(1 for i in tree.leaves[node] if i in present)
            a = (v - root) + (v - up)
            out[node] = a / math.sqrt(n) if self.config.leaf_scaling else a
        return out

    def estimate(self, group: RolloutGroup) -> Advantages:
        checked_rewards(group)  # an unscored rollout is named before a missing tree
        tree = self._tree(group)
        advantages = self.node_advantages(group)
        by_id = {r.rollout_id: r for r in group.rollouts}
        values = []
        for r in group.rollouts:
            path = sorted((node for node, ids in tree.leaves.items() if r.rollout_id in ids),
                          key=lambda node: -sum(1 for i in tree.leaves[node] if i in by_id))
            a = np.zeros(len(r), dtype=np.float64)
            start = 0
            for node in path:
                if tree.spans:
                    begin, end = tree.spans[node]
                else:
                    members = [by_id[i] for i in tree.leaves[node] if i in by_id]
                    begin, end = start, max(start, _agreed_length(members))
                a[begin:end] = advantages[node]
                start = end
            values.append(a)
        return Advantages(tuple(values))

    @staticmethod
    def _tree(group: RolloutGroup):
        if group.tree is None:
            raise ValueError(f"group {group.group_id} has no tree (RolloutGroup.tree), and advantage `tree` needs "
                             "one; generate it with `generate.tree`, or use a group estimator such as `mean_std`")
        return group.tree

    @staticmethod
    def pairing_problems(config: "TreeAdvantage.Config", ctx: PairingContext) -> list[PipelineProblem]:
        """A tree generator upstream of the update."""
        if ctx.trees_upstream:
            return []
        return [PipelineProblem(
            ("advantage", "use"),
            "advantage `tree` needs tree groups (node values over the leaves below each branch point), "
            "and no stage upstream of the update generates trees",
            "generate with `generate.tree` (e.g. `rollout: {use: generate.tree, from: budget}`), or "
            "use a group estimator such as `mean_std`")]
