"""GRESO (``control.greso``) against Infini-AI-Lab/GRESO: the skip probabilities of a prompt
after a trace of groups (``skip_probability`` on the stage's own statistics), and the
``p_easy`` / ``p_hard`` update after a step with given all-correct and all-wrong ratios."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gfcr.records import StepReport
from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "greso"
TUNE_GROUPS = 300  # the step's groups: every ratio of the cases is a whole number of them


def _stage() -> Any:
    cls = STAGES.get("control.greso")
    return cls(cls.Config(batch_size=1))


def _observe(stage: Any, step: int, groups: list) -> None:
    stage.observe(StepReport("run", step, step + 1, tuple(groups), None, {}, {}))


def skip(inp: dict[str, Any]) -> list[float]:
    """The reference's list: the easy test's P_skip, then the hard test's when it runs."""
    stage = _stage()
    for step, rewards in enumerate(inp["trace"]):
        _observe(stage, step, [scored_group("x", rewards, step)])
    if "x" not in stage.stats:
        return []
    module = sys.modules[type(stage).__module__]
    p, kind = module.skip_probability(stage.stats["x"], inp["p_easy"], inp["p_hard"])
    return [0.0, p] if kind == "hard" else [p]


def tune(inp: dict[str, Any]) -> list[float]:
    stage = _stage()
    stage.epoch, stage.p_easy, stage.p_hard = 1, inp["p_easy"], inp["p_hard"]
    easy, hard = (round(inp[k] * TUNE_GROUPS) for k in ("easy_ratio", "hard_ratio"))
    rewards = [[1, 1]] * easy + [[0, 0]] * hard + [[1, 0]] * (TUNE_GROUPS - easy - hard)
    _observe(stage, 0, [scored_group(f"p{i}", r) for i, r in enumerate(rewards)])
    return [stage.p_easy, stage.p_hard]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_greso_matches_the_reference(case):
    check(METHOD, case, skip if case["input"]["kind"] == "skip" else tune)
