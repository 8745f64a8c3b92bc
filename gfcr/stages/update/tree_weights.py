"""Shared-prefix token weights of a tree group: a token that several leaves share counts once.

A tree rollout (TreeRL, arXiv 2506.11902; TreePO, arXiv 2508.17445) stores one ``Rollout``
per leaf, each with its whole response, so the tokens of a shared prefix appear in every leaf
below the branch. ``RolloutGroup.tree.leaves`` maps each tree node to the leaf rollouts below
it. The rule:

    w_r(t) = 1 / k_r(t),  k_r(t) = the number of leaves of the LARGEST tree node that holds
                          leaf r and whose leaves all have the same tokens at positions 0..t
                          (1 when there is none)

So a position shared by the ``k`` leaves of a node has weight ``1/k`` in each of them and
counts once in total, in the loss and, under ``token_mean``, in its denominator; the tokens
after a leaf's branch point have weight 1. The nodes are nested (a tree), so the largest such
node is the same for all its leaves and the weights of one shared position sum to 1.

When the tree records its nodes' spans (``TreeIndex.spans``, as ``generate.tree`` writes them),
a position of a leaf has the weight ``1/|leaves(s)|`` of the node ``s`` whose span holds it on
the leaf's path: the same rule, with the spans known rather than read from the tokens.

Deviations:
- without recorded spans, they are read from the tokens: a node's shared span ends where its
  leaves stop agreeing. When every child of a node happens to sample the same first token
  after the branch point, that token is taken as shared (the same token in the same context:
  the same log-probability and gradient);
- TreeRL weights its node advantages by ``1/sqrt(|leaves|)`` as part of its advantage
  (``compute_weighted_update(..., "sqrt")``); that belongs to a tree advantage estimator, and
  this weight only removes the duplicate count of the shared tokens.

Example (three leaves: two share 4 tokens, all three share 2):

>>> from gfcr.records import Rollout, RolloutGroup, Segment, TreeIndex
>>> def leaf(i, tokens):
...     return Rollout(f"g/{i}", "g", "p", tokens, [Segment(0, len(tokens), 0, [0.0] * len(tokens))])
>>> leaves = [leaf(0, [1, 2, 3, 4, 5]), leaf(1, [1, 2, 3, 4, 6]), leaf(2, [1, 2, 7])]
>>> tree = TreeIndex(leaves={"root": ["g/0", "g/1", "g/2"], "a": ["g/0", "g/1"], "b": ["g/2"]})
>>> w = shared_prefix_weights(RolloutGroup("g", "p", 0, 3, leaves, tree=tree))
>>> [[round(float(x), 3) for x in w[r.rollout_id]] for r in leaves]
[[0.333, 0.333, 0.5, 0.5, 1.0], [0.333, 0.333, 0.5, 0.5, 1.0], [0.333, 0.333, 1.0]]
"""

from __future__ import annotations

import numpy as np

from gfcr.records import Rollout, RolloutGroup


def _agreed_length(leaves: list[Rollout]) -> int:
    """How many leading positions every one of ``leaves`` has, with the same tokens."""
    if len(leaves) == 1:
        return len(leaves[0])
    shortest = min(len(r) for r in leaves)
    tokens = np.array([r.response_token_ids[:shortest] for r in leaves])  # [k, shortest]
    differs = np.flatnonzero((tokens != tokens[0]).any(axis=0))
    return int(differs[0]) if len(differs) else shortest


def shared_prefix_weights(group: RolloutGroup) -> dict[str, np.ndarray]:
    """``rollout_id -> [T] float64`` weights of a tree group; empty for a group without a tree."""
    if group.tree is None:
        return {}
    by_id = {r.rollout_id: r for r in group.rollouts}
    if group.tree.spans:
        return _weights_from_spans(group, by_id)
    nodes = [[by_id[i] for i in ids if i in by_id] for ids in group.tree.leaves.values()]
    nodes = sorted((n for n in nodes if n), key=len)  # smallest first: a larger node overrides
    weights = {r.rollout_id: np.ones(len(r), dtype=np.float64) for r in group.rollouts}
    for leaves in nodes:
        agreed = _agreed_length(leaves)
        for r in leaves:
            weights[r.rollout_id][:agreed] = 1.0 / len(leaves)
    return weights


def _weights_from_spans(group: RolloutGroup, by_id: dict[str, Rollout]) -> dict[str, np.ndarray]:
    """Each node's span, in each of its leaves still in the group, weighs 1 / (those leaves)."""
    weights = {r.rollout_id: np.ones(len(r), dtype=np.float64) for r in group.rollouts}
    for node, ids in group.tree.leaves.items():
        present = [i for i in ids if i in by_id]
        start, end = group.tree.spans.get(node, (0, 0))
        for i in present:
            weights[i][start:end] = 1.0 / len(present)
    return weights
