"""MEDS (``filter.meds``'s shaped reward, then the ``mean_std`` advantage) against the "MEDS"
estimator of Linxi000/MEDS, given each rollout's cluster size and correctness: target ``both``
(the estimator shapes every rollout it is given a size for), the stage's default ``alpha`` and
``beta``."""

from __future__ import annotations

import sys
from typing import Any

import pytest

from gfcr.registry import STAGES
from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from gfcr.stages.testing import scored_group
from tests.fidelity.cases import case_ids, cases, check

METHOD = "meds"


def advantages(inp: dict[str, Any]) -> list[float]:
    cls = STAGES.get("filter.meds")
    cfg, module = cls.Config(target="both"), sys.modules[cls.__module__]
    rewards = [module.shaped(r, ok, module.meds_penalty(size, cfg.alpha, cfg.beta))
               for r, size, ok in zip(inp["rewards"], inp["cluster_sizes"], inp["correct"])]
    group = scored_group("p", rewards)
    estimator = ADVANTAGE_ESTIMATORS.get("mean_std")
    return [float(a) for a in estimator(estimator.Config()).estimate(group).values]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_meds_matches_the_reference(case):
    check(METHOD, case, advantages)
