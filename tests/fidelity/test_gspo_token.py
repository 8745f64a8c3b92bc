"""GSPO-token (loss ``gspo_token``) against verl's ``compute_policy_loss_gspo``: the batch's loss
(``seq_mean_token_mean``) and its gradient w.r.t. the current log-probs."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fidelity.cases import case_ids, cases, check, check_setting
from tests.fidelity.update_terms import loss_terms

METHOD = "gspo_token"


def loss_and_grad(inp: dict[str, Any]) -> dict[str, Any]:
    out = loss_terms(inp, "gspo_token", "seq_mean_token_mean", clip=tuple(inp["clip"]))
    return {"loss": out["loss"], "grad": out["grad"]}


@pytest.mark.parametrize("case", cases(METHOD), ids=case_ids(METHOD))
def test_gspo_token_matches_the_reference(case):
    check(METHOD, case, loss_and_grad)


CAP = "gspo_token_cap"


@pytest.mark.parametrize("case", cases(CAP), ids=case_ids(CAP))
def test_gspo_token_past_verls_log_ratio_cap(case):
    check(CAP, case, loss_and_grad)


def capped_loss_and_grad(inp: dict[str, Any]) -> dict[str, Any]:
    out = loss_terms(inp, "gspo_token", "seq_mean_token_mean", clip=tuple(inp["clip"]), log_ratio_cap=10.0)
    return {"loss": out["loss"], "grad": out["grad"]}


@pytest.mark.parametrize("case", cases(CAP) + cases(METHOD), ids=case_ids(CAP) + case_ids(METHOD))
def test_gspo_token_with_verls_cap_matches_every_case(case):
    check_setting(CAP if case in cases(CAP) else METHOD, case, capped_loss_and_grad)
