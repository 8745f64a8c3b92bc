"""Pilot-Commit's join (``replay.pilot_join``) against databricks/pilot-commit: each committed
prompt's update group (its stored pilots joined to its commit rollouts under one uid) and the
GRPO advantages verl computes over it; the step's own pilot groups are not trained on."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import Allocation, AllocationEntry, Origin, Prompt, RolloutGroups, StepContext
from gfcr.registry import STAGES
from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "pilot_join"


def joined(inp: dict[str, Any]) -> dict[str, Any]:
    entries = [AllocationEntry(Prompt(p, text=p), 2, reason="pilot") for p in inp["pilots_this_step"]]
    entries += [AllocationEntry(Prompt(c["prompt"], text=c["prompt"]), inp["n_commit"], reason="commit", stage_index=1,
                                joins=tuple(scored_group(c["prompt"], c["pilots"], step=0).rollouts))
                for c in inp["commits"]]
    groups = [scored_group(p, [0, 1], step=1) for p in inp["pilots_this_step"]]
    groups += [scored_group(c["prompt"], c["commits"], step=1) for c in inp["commits"]]
    cls = STAGES.get("replay.pilot_join")
    out = cls(cls.Config()).run(RolloutGroups(groups), Allocation(1, tuple(entries)), StepContext("r", 1, 0, 1))
    estimator = ADVANTAGE_ESTIMATORS.get("mean_std")
    result = {}
    for group in out:
        values = [float(a) for a in estimator(estimator.Config()).estimate(group).values]
        pilot = [r.origin == Origin.REPLAYED for r in group.rollouts]
        result[group.prompt_id] = {"size": len(group.rollouts),
                                   "pilot_advantages": [a for a, p in zip(values, pilot) if p],
                                   "commit_advantages": [a for a, p in zip(values, pilot) if not p]}
    return result


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_pilot_join_matches_the_reference(case):
    check(METHOD, case, joined)
