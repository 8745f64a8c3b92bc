"""CoBA-RL (``control.coba``) against ``BetaAllocator`` of Within-yao/CoBA-RL, driven step by step
as its trainer drives it: each case is a trace of steps (the batch's prompts and, after the
allocation, every rollout's reward); at each step the stage's allocation, the heap's ``tau``
and the value curve's ``alpha``, ``beta`` must equal the reference's."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import Allocation, AllocationEntry, Prompt, StepContext, StepReport
from gfcr.registry import STAGES
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "coba"


def replay(inp: dict[str, Any]) -> list[dict[str, Any]]:
    cls = STAGES.get("control.coba")
    stage = cls(cls.Config(mean_rollouts=inp["mean_rollouts"], **inp["config"]))
    out = []
    for step, s in enumerate(inp["steps"]):
        stage.before_step(StepContext("run", step, 0, step))
        picked = Allocation(step, tuple(AllocationEntry(Prompt(p, text=p), 1) for p in s["prompts"]))
        alpha, beta = stage.shape
        sized = stage.run(picked)
        out.append({"n": [e.n_rollouts for e in sized], "tau": stage.step_metrics().get("tau"),
                    "alpha": alpha, "beta": beta})
        groups = tuple(scored_group(p, r, step=step) for p, r in zip(s["prompts"], s["rewards"]))
        stage.observe(StepReport("run", step, step + 1, groups, None, {}, {}))
    return out


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_coba_matches_the_reference(case):
    check(METHOD, case, replay)
