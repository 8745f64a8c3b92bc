"""GRPO's group-normalised advantage (advantage ``mean_std``) against verl's ``compute_grpo_outcome_advantage``:
one group's advantages per case."""

from __future__ import annotations

import pytest

from tests.fidelity.cases import case_ids, cases, check, check_setting
from tests.fidelity.update_terms import group_advantages

METHOD = "mean_std"


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_mean_std_matches_the_reference(case):
    check(METHOD, case, group_advantages(METHOD))


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_mean_std_with_verls_settings_matches_every_case(case):
    check_setting(METHOD, case, group_advantages(METHOD, single_rollout="verl", precision="float32"))
