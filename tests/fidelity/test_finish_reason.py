"""DAPO's overlong filtering (``filter.finish_reason`` with ``action: mask``) against SkyRL's
``apply_overlong_filtering``: every rollout's loss mask after the filter."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment
from gfcr.stages.filter.finish_reason import FinishReasonFilter
from tests.fidelity.cases import case_ids, cases, check

METHOD = "finish_reason"


def filtered_masks(inp: dict[str, Any]) -> list[list[int]]:
    rollouts = []
    for i, (mask, reason) in enumerate(zip(inp["loss_masks"], inp["finish_reasons"])):
        n = len(mask)
        rollout = Rollout(f"g/{i}", "g", "p", [1] * n, [Segment(0, n, 0, np.zeros(n))], finish_reason=reason,
                          reward=1.0)
        rollout.loss_mask = np.asarray(mask, dtype=bool)  # [T]
        rollouts.append(rollout)
    stage = FinishReasonFilter(FinishReasonFilter.Config(reasons=inp["reasons"], action="mask"))
    stage.run(RolloutGroups([RolloutGroup("g", "p", 0, len(rollouts), rollouts)]))
    return [[int(t) for t in r.loss_mask] for r in rollouts]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_finish_reason_matches_the_reference(case):
    check(METHOD, case, filtered_masks)
