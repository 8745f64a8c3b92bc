"""Rollout-GDRO (``control.gdro_rollout``'s arm choice) against ``rollout_choose_arms`` of
kishanpb/verl-gdro: the group size of every bin, given its arm scores, the prompts per bin and
the budget ``n_bar * |batch|``."""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from gfcr.registry import STAGES
from tests.fidelity.cases import case_ids, cases, check

METHOD = "gdro_rollout"


def arms(inp: dict[str, Any]) -> dict[str, Any]:
    cls = STAGES.get("control.gdro_rollout")
    module, cfg = sys.modules[cls.__module__], cls.Config()
    choice = tuple(range(inp["n_min"], inp["n_max"] + 1))
    log_probs = {b: np.log(module.arm_probabilities(np.array(s), cfg.eta, cfg.gamma)).tolist()
                 for b, s in inp["scores"].items()}
    budget = inp["n_bar"] * sum(inp["counts"].values())
    chosen = module.best_arms(dict(inp["counts"]), choice, log_probs, budget, inp["n_bar"])
    return {"arms": chosen, "total": sum(inp["counts"][b] * n for b, n in chosen.items())}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_rollout_gdro_arms_match_the_reference(case):
    check(METHOD, case, arms)
