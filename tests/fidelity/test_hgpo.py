"""HGPO (advantage ``hgpo`` of ``update.grpo``) against ``compute_step_discounted_returns`` and
``compute_hgpo_outcome_advantage`` of the HGPO recipe (OliverLeeXZ/SERL ``recipe/hgpo/core_hgpo.py``):
one group of trajectories per case, each step's advantage."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.records import RolloutGroup
from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import trajectory
from tests.fidelity.cases import case_ids, cases, check

METHOD = "hgpo"


def group(trajectories: list[dict[str, Any]]) -> RolloutGroup:
    """Each trajectory's first observation is the prompt; the others are environment turns before
    its later model turns (two tokens a model turn)."""
    rollouts = []
    for i, t in enumerate(trajectories):
        parts: list[Any] = []
        for k, (obs, reward) in enumerate(zip(t["observations"], t["turn_rewards"])):
            parts += ([] if k == 0 else [obs]) + [(2, reward)]
        rollouts.append(trajectory(f"g/{i}", parts))
    return RolloutGroup("g", "p", 0, len(rollouts), rollouts)


def step_advantages(inp: dict[str, Any]) -> list[list[float]]:
    cfg = inp["config"]
    cls = ADVANTAGE_ESTIMATORS.get("hgpo")
    estimator = cls(cls.Config(history_length=cfg["history_length"], mode=cfg["mode"],
                               length_weight_alpha=cfg["alpha"], base_group=cfg["base_group"], gamma=cfg["gamma"]))
    g = group(inp["trajectories"])
    by_step = estimator.step_advantages(g)
    per_token = estimator.estimate(g).values
    for r, steps, tokens in zip(g.rollouts, by_step, per_token):  # each model turn's tokens carry its step's value
        model = [t for t in r.turns if t.role == "model"]
        assert [float(tokens[t.start]) for t in model] == steps
        assert all(float(tokens[t.start]) == 0.0 for t in r.turns if t.role == "environment")
    return by_step


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_hgpo_matches_the_reference(case):
    check(METHOD, case, step_advantages)
