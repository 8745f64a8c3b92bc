"""DAPO's overlong penalty (``filter.overlong``) against OpenRLHF's ``apply_overlong_penalty``:
the rewards of responses of lengths around the buffer's edges, after the penalty."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
from gfcr.stages.filter.overlong import Overlong
from tests.fidelity.cases import case_ids, cases, check

METHOD = "overlong"


def penalised(inp: dict[str, Any]) -> list[float]:
    rollouts = [Rollout(f"g/{i}", "g", "p", [1] * n, [Segment(0, n, 0, np.zeros(n))], reward=r)
                for i, (n, r) in enumerate(zip(inp["lengths"], inp["rewards"]))]
    stage = Overlong(Overlong.Config(max_length=inp["max_length"], buffer=inp["buffer"],
                                     penalty_factor=inp["penalty_factor"]))
    stage.run(RolloutGroups([RolloutGroup("g", "p", 0, len(rollouts), rollouts)]))
    return [r.reward for r in rollouts]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_overlong_matches_the_reference(case):
    check(METHOD, case, penalised)
