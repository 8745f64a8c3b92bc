"""RLOO (advantage ``rloo``) against verl's ``compute_rloo_outcome_advantage``:
one group's advantages per case."""

from __future__ import annotations

from typing import Any

import pytest

from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "rloo"


def advantages(inp: dict[str, Any]) -> list[float]:
    cls = ADVANTAGE_ESTIMATORS.get("rloo")
    return [float(a) for a in cls(cls.Config()).estimate(scored_group("p", inp["rewards"])).values]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_rloo_matches_the_reference(case):
    check(METHOD, case, advantages)
