"""Prompt-GDRO (``filter.gdro_weights``) against ``ClassDroExp3p`` of kishanpb/verl-gdro: each
case runs a few steps (weights, then ``observe``) and compares every group's weight."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import RolloutGroups, StepReport
from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "gdro_weights"


def run(inp: dict[str, Any]) -> list[list[float]]:
    stage_cls = STAGES.get("filter.gdro_weights")
    stage = stage_cls(stage_cls.Config(**{**inp["config"], "edges": tuple(inp["config"]["edges"])}))
    weights = []
    for step, batch in enumerate(inp["steps"]):
        groups = RolloutGroups([scored_group(prompt, rewards, step) for prompt, rewards in batch])
        stage.run(groups)
        weights.append([g.sample_weight for g in groups])
        stage.observe(StepReport("run", step, step + 1, tuple(groups), None, {}, {}))
    return weights


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_prompt_gdro_matches_the_reference(case):
    check(METHOD, case, run)
