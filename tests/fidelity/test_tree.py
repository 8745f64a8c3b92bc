"""TreeRL (``generate.tree``'s branch-point choice) against the per-tree selection loop of
THUDM/TreeRL's ``entropy_guided_chain`` over ``TreeNode``s: which (tree, node, token) points
one iteration branches from, in order, given every node's own log-probs (uncertainty
``neg_logprob``, the reference's "entropy")."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from gfcr.records import Segment
from gfcr.registry import STAGES
from tests.fidelity.cases import case_ids, cases, check

METHOD = "tree"


def branch_points(inp: dict[str, Any]) -> list[list[int]]:
    cls = STAGES.get("generate.tree")
    module = sys.modules[cls.__module__]
    stage = cls(cls.Config(top_n=inp["n"], uncertainty="neg_logprob"))
    seqs, where = [], []  # where[q]: (tree, node index in the tree)
    for tree, nodes in enumerate(inp["trees"]):
        first = len(seqs)
        for k, (parent, split, logps) in enumerate(nodes):
            prefix = [] if parent is None else list(seqs[first + parent].segments[0].behavior_logprobs[
                :seqs[first + parent].fork + split])
            values = prefix + list(logps)
            source = None if parent is None else first + parent
            seqs.append(module.Sequence_(tree, list(range(len(values))), [Segment(0, len(values), 0, np.array(values))],
                                         None, None, source, len(prefix)))
            where.append((tree, k))
    return [[*where[q], t - seqs[q].fork] for q, t in stage._branch_points(seqs)]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_tree_branch_points_match_the_reference(case):
    check(METHOD, case, branch_points)
