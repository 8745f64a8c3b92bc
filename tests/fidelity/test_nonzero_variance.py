"""DAPO's zero-variance filter (``filter.nonzero_variance``) against verl's DAPO recipe: which
groups of one generation batch are kept."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
from gfcr.stages.filter.nonzero_variance import NonzeroVariance
from tests.fidelity.cases import case_ids, cases, check

METHOD = "nonzero_variance"


def kept(inp: dict[str, Any]) -> list[int]:
    groups = []
    for g, rewards in enumerate(inp["rewards"]):
        rollouts = [Rollout(f"{g}:{i}", str(g), str(g), [1], [Segment(0, 1, 0, np.zeros(1))],
                            reward=float(r), correct=r == 1) for i, r in enumerate(rewards)]
        groups.append(RolloutGroup(str(g), str(g), 0, len(rollouts), rollouts))
    out = NonzeroVariance(NonzeroVariance.Config()).run(RolloutGroups(groups))
    return [int(g.group_id) for g in out]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_nonzero_variance_matches_the_reference(case):
    check(METHOD, case, kept)
