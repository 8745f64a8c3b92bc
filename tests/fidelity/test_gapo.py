"""GAPO (advantage ``gapo`` of ``update.grpo``) against ``compute_grpo_outcome_advantage`` with
``find_method: median`` of TsingZ0/verl-GAPO: one group's advantages per case."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "gapo"


def advantages(inp: dict[str, Any]) -> list[float]:
    cls = ADVANTAGE_ESTIMATORS.get("gapo")
    estimator = cls(cls.Config(fraction=inp["fraction"]))
    return [float(a) for a in estimator.estimate(scored_group("p", inp["rewards"])).values]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_gapo_matches_the_reference(case):
    check(METHOD, case, advantages)
