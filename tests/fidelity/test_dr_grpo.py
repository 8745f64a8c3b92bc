"""Dr.GRPO's advantage (advantage ``dr_grpo``) against verl's
``compute_grpo_outcome_advantage`` with ``norm_adv_by_std_in_grpo=False``: one group's
advantages per case."""

from __future__ import annotations

import pytest

from tests.fidelity.cases import case_ids, cases, check, check_setting
from tests.fidelity.update_terms import group_advantages

METHOD = "dr_grpo"


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_dr_grpo_matches_the_reference(case):
    check(METHOD, case, group_advantages(METHOD))


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_dr_grpo_with_verls_settings_matches_every_case(case):
    check_setting(METHOD, case, group_advantages(METHOD, single_rollout="verl"))
