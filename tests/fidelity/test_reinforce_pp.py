"""REINFORCE++ with baseline (advantage ``reinforce_pp``) against OpenRLHF's
``compute_advantages_and_returns`` with ``--advantage_estimator reinforce_baseline`` (and
verl's variant), and REINFORCE++ without one (``reinforce_pp_plain``) against the same
function with ``reinforce``: every rollout's advantage after the batch-wide, token-weighted
whitening."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from gfcr.records import Rollout, RolloutGroup, Segment
from gfcr.registry.catalog import ADVANTAGE_ESTIMATORS
from tests.fidelity.cases import case_ids, cases, check, check_setting

METHOD = "reinforce_pp"


def _groups(inp: dict[str, Any]) -> list[RolloutGroup]:
    masks = iter(inp["loss_masks"] or [])
    groups = []
    for k, (rewards, lengths) in enumerate(zip(inp["groups"], inp["lengths"])):
        rollouts = []
        for i, (r, n) in enumerate(zip(rewards, lengths)):
            rollout = Rollout(f"g{k}/{i}", f"g{k}", f"p{k}", [1] * n, [Segment(0, n, 0, np.zeros(n))], reward=float(r))
            if inp["loss_masks"] is not None:
                rollout.loss_mask = np.asarray(next(masks), dtype=bool)  # [T]
            rollouts.append(rollout)
        groups.append(RolloutGroup(f"g{k}", f"p{k}", 0, len(rollouts), rollouts))
    return groups


def advantages(inp: dict[str, Any], alias: str = "reinforce_pp", **config: Any) -> list[list[float]]:
    cls = ADVANTAGE_ESTIMATORS.get(alias)
    out = cls(cls.Config(std_norm=inp["std_norm"], **config)).estimate_batch(_groups(inp), None)
    return [[float(a) for a in group.values] for group in out]


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_reinforce_pp_matches_the_reference(case):
    check(METHOD, case, advantages)


@pytest.mark.parametrize("case", cases("reinforce_pp_verl"), ids=case_ids("reinforce_pp_verl"))
def test_reinforce_pp_against_verl_differs_only_as_documented(case):
    check("reinforce_pp_verl", case, advantages)


def advantages_plain(inp: dict[str, Any]) -> list[list[float]]:
    return advantages(inp, "reinforce_pp_plain")


@pytest.mark.parametrize("case", cases("reinforce_pp_plain"), ids=case_ids("reinforce_pp_plain"))
def test_reinforce_pp_plain_matches_the_reference(case):
    check("reinforce_pp_plain", case, advantages_plain)


@pytest.mark.parametrize("case", cases("reinforce_pp_verl"), ids=case_ids("reinforce_pp_verl"))
def test_reinforce_pp_with_verls_settings_matches_every_case(case):
    check_setting("reinforce_pp_verl", case, lambda inp: advantages(inp, variance="unbiased", single_rollout="verl"))


@pytest.mark.parametrize("case", cases("reinforce_pp_plain_verl"), ids=case_ids("reinforce_pp_plain_verl"))
def test_reinforce_pp_plain_against_verl_differs_only_as_documented(case):
    check("reinforce_pp_plain_verl", case, advantages_plain)


@pytest.mark.parametrize("case", cases("reinforce_pp_plain_verl"), ids=case_ids("reinforce_pp_plain_verl"))
def test_reinforce_pp_plain_with_verls_setting_matches_every_case(case):
    check_setting("reinforce_pp_plain_verl", case, lambda inp: advantages(inp, "reinforce_pp_plain", variance="unbiased"))
