"""DAPO's dynamic sampling (``filter.dynamic_sampling`` in a loop block) against verl's DAPO
recipe: which rollouts reach the update, and how many generation batches it took."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.records import Rollout, RolloutGroup, RolloutGroups, Segment, StepContext
from gfcr.stages.filter.dynamic_sampling import DynamicSampling
from tests.fidelity.cases import case_ids, cases, check

METHOD = "dynamic_sampling"


def group(label: str, values: list[float]) -> RolloutGroup:
    """A group of one-token rollouts whose reward is the metric's value (1 counts as correct)."""
    rollouts = [Rollout(f"{label}:{i}", label, label, [1], [Segment(0, 1, 0, np.zeros(1))],
                        reward=float(v), correct=v == 1) for i, v in enumerate(values)]
    return RolloutGroup(label, label, 0, len(rollouts), rollouts)


def collected(inp: dict[str, Any]) -> dict[str, Any]:
    """The loop block as the runtime runs it: a round per generation batch until the stage is
    done or ``max_rounds`` (verl's ``max_num_gen_batches``; 0 there is endless) is reached."""
    metric = "acc" if inp["metric"] == "acc" else "reward"  # verl's score, seq_reward, seq_final_reward
    stage = DynamicSampling(DynamicSampling.Config(target_groups=inp["train_batch_size"], metric=metric))
    stage.before_step(StepContext("run", step=0, seed=0, policy_version=0))
    max_rounds = inp["max_num_gen_batches"] or len(inp["rounds"])
    batch = RolloutGroups([])
    for r, groups in enumerate(inp["rounds"][:max_rounds], start=1):
        batch = stage.run(RolloutGroups([group(f"{r - 1}:{g}", v) for g, v in enumerate(groups)]))
        if stage.done():
            break
    return {"error": False, "rounds": r, "rollouts": [x.rollout_id for g in batch for x in g.rollouts]}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_dynamic_sampling_matches_the_reference(case):
    check(METHOD, case, collected)
